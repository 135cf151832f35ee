"""``docs/configuration.md`` is generated from the launcher's parser: it fails here while stale."""

from __future__ import annotations

import re

from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.server import config_docs


def test_configuration_page_is_the_generators_output():
    page = config_docs.PAGE.read_text() if config_docs.PAGE.exists() else ""
    assert page == config_docs.render(), f"docs/configuration.md is stale: run `.venv/bin/{config_docs.COMMAND}`"


def test_page_lists_every_flag_once_as_clean_myst():
    page = config_docs.render()
    rows = re.findall(r"^\| `(--loopkv-[a-z0-9-]+)` \|", page, re.M)
    assert rows == [o.flag for o in sorted(LoopKVConfig.options(), key=lambda o: o.baseline)]
    assert page.count("\n# ") == 0 and page.startswith("# Configuration\n")
    for line in page.splitlines():
        if line.startswith("| "):  # every row has exactly its 4 cells: no unescaped | inside one
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line
    assert not re.search(r"(?<![\\`])<[a-z]", page), "raw HTML"
    assert config_docs.text("a | b <c> $x *y* --loopkv-x-y") == r"a \| b \<c\> \$x \*y\* `--loopkv-x-y`"
