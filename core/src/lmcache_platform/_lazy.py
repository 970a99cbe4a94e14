"""``lazy_exports``: a package's public names, imported from their modules on first access."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) importing each public name from its home on first access.

    For a backend package's ``__init__``: the entry point imports the package, which must
    stay light (no torch, no wrapper module), while ``from <backend> import Wrapper`` still
    works. ``homes`` maps a module, relative to ``package``, to the names it defines::

        __getattr__ = lazy_exports(__name__, {"._wrapper": ["MyIPCWrapper"], "._gc": ["reclaim"]})

    Keep the names in ``__all__`` and import them under ``TYPE_CHECKING`` too, so type
    checkers see them. Any other name raises ``AttributeError``, as a missing attribute
    of a module does.
    """
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
