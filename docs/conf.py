"""Sphinx configuration of the sgl-loopkv docs (MyST Markdown, furo). Built strictly by .ci/run:
``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``."""

import os
import sys

# docs/_ext/bench_staleness.py: marks a benchmark page stale at build time (git), never in the page
sys.path.insert(0, os.path.abspath("_ext"))

project = "sgl-loopkv"
author = "sgl-loopkv developers"
extensions = ["myst_parser", "bench_staleness"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "sgl-loopkv"
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
# Pages link to source files and results by path in code spans, not as links: a link to a file outside
# docs/ would be a broken reference under -n.
suppress_warnings: list[str] = []
