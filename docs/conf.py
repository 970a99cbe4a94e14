"""Sphinx configuration. Built by `make docs` (part of `make test`) with warnings as errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docstrings import prepare_docstring

root = Path(__file__).resolve().parent.parent
for src in ("core/src", "plugins-cpu/src", "plugins-cuda/src", "backends/cpu-file/src"):
    sys.path.insert(0, str(root / src))

project = "lmcache-platform"
author = "lmcache-platform developers"
copyright = "2026, lmcache-platform developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = ["torch"]

# Every cross-reference must resolve, except to these classes of other libraries: the
# build is offline, so intersphinx cannot fetch their inventories.
nitpicky = True
nitpick_ignore = [
    # Python's standard library (Future is defined in concurrent.futures._base).
    *(("py:class", f"collections.abc.{name}") for name in ("Callable", "Iterator", "Mapping", "Sequence")),
    *(("py:class", f"concurrent.futures.{name}") for name in ("Future", "_base.Future")),
    *(("py:class", name) for name in ("mmap.mmap", "pathlib.Path", "types.SimpleNamespace")),
    # torch (mocked while the docs build).
    *(("py:class", f"torch.{name}") for name in ("Size", "Tensor", "device", "dtype")),
    # pytest (MonkeyPatch is defined in _pytest.monkeypatch).
    *(("py:class", name) for name in ("pytest.MonkeyPatch", "_pytest.monkeypatch.MonkeyPatch")),
]
# The type variables of generic classes and methods (a request's result type ``R``).
nitpick_ignore_regex = [("py:class", r"lmcache_platform(\.\w+)*\.R")]

# Private aliases in public signatures, shown as the public types they stand for.
_PRIVATE_ALIASES = {
    "KVCacheEntry": "lmcache_platform.DeviceIPCWrapper | tuple[lmcache_platform.DeviceIPCWrapper, "
    "lmcache_platform.DeviceIPCWrapper]",
    "LayerKV": "torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
    "LayerTensors": "torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
    "lmcache_platform._env._Choice": "str",
    "ChunkIds": "lmcache_platform.CheckedChunk | collections.abc.Sequence[collections.abc.Sequence[int]]",
    "ChunkLike": "lmcache_platform.server.Chunk | "
    "tuple[str | bytes, collections.abc.Sequence[collections.abc.Sequence[int]]]",
}

# Constructors only the package calls (the base cache context builds its groups manager and
# checked chunks, the lmcache_registry fixture its handle): documented without a parameter list.
_INTERNAL_CONSTRUCTORS = {
    "lmcache_platform.KVLayerGroupsManager",
    "lmcache_platform.CheckedChunk",
    "lmcache_platform.testing.RegistryFixture",
}
# Parameters of a class internal to the package: listed without that type (the docstring says
# what they take).
_INTERNAL_PARAMETERS = {"lmcache_platform.server.ReferenceServer": ("tier",)}


def _drop_type_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A constant's text is its ``#:`` comment or what docs/api.md says, never its type's docstring."""
    if (
        what == "data"
        and lines
        and type(obj).__doc__
        and [line for line in lines if line]
        == [line for line in prepare_docstring(type(obj).__doc__) if line]
    ):
        lines.clear()


def _drop_internal_signature(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str | None, return_annotation: str
) -> tuple[str, str] | None:
    """No parameter list for data (a marker's call is pluggy's) and for internal constructors."""
    annotations = app.env.current_document.autodoc_annotations
    if what == "data" or name in _INTERNAL_CONSTRUCTORS:
        annotations.pop(name, None)
        return ("", "") if name in _INTERNAL_CONSTRUCTORS else None
    for parameter in _INTERNAL_PARAMETERS.get(name, ()):
        annotations.get(name, {}).pop(parameter, None)
    return None


def _expand_private_alias(app: Sphinx, env: Any, node: Any, contnode: Any) -> nodes.Node | None:
    """Replace a reference to a private alias by its expansion, each public class linked."""
    expansion = _PRIVATE_ALIASES.get(node["reftarget"]) if node.get("refdomain") == "py" else None
    if expansion is None:
        return None
    python = env.domains["py"]
    result = nodes.inline()
    for part in re.split(r"([\w.]+)", expansion):
        title = nodes.Text(part.removeprefix("lmcache_platform."))
        ref = (
            python.resolve_xref(env, node["refdoc"], app.builder, "class", part, node, title)
            if part
            else None
        )
        result += ref if ref is not None else title
    return result


def setup(app: Sphinx) -> None:
    # Before napoleon (priority 500), so the type's docstring is compared unchanged.
    app.connect("autodoc-process-docstring", _drop_type_docstring, priority=400)
    app.connect("autodoc-process-signature", _drop_internal_signature)
    app.connect("missing-reference", _expand_private_alias)
