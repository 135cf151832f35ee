"""Sphinx configuration of the sgl-loopkv docs (MyST Markdown, furo). Built strictly by .ci/run:
``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``."""

project = "sgl-loopkv"
author = "sgl-loopkv developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "sgl-loopkv"
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
# Pages link to source files and results by path in code spans, not as links: a link to a file outside
# docs/ would be a broken reference under -n.
suppress_warnings: list[str] = []
