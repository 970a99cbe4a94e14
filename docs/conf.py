"""Sphinx configuration. Built by `make docs` (part of `make test`) with warnings as errors."""

from __future__ import annotations

import sys
from pathlib import Path

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
suppress_warnings = ["myst.xref_missing"]
