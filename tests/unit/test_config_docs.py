"""``docs/configuration.md`` is generated from the launcher's parser: it fails here while stale."""

from __future__ import annotations

import re

from sgl_loopkv.config import RENAMED, LoopKVConfig
from sgl_loopkv.server import config_docs


def test_configuration_page_is_the_generators_output():
    page = config_docs.PAGE.read_text() if config_docs.PAGE.exists() else ""
    assert page == config_docs.render(), f"docs/configuration.md is stale: run `.venv/bin/{config_docs.COMMAND}`"


def test_page_lists_every_flag_once_as_clean_myst():
    page = config_docs.render()
    flags, renamed = page.split(f"({config_docs.target('Renamed flags')})=")
    rows = re.findall(r"^\| `(--loopkv-[a-z0-9-]+)` \|", flags, re.M)
    assert rows == [o.flag for o in sorted(LoopKVConfig.options(), key=lambda o: o.baseline)]
    pairs = re.findall(r"^\| `(--loopkv-[a-z0-9-]+)` \| `(--loopkv-[a-z0-9-]+)` \|$", renamed, re.M)
    assert pairs == [(LoopKVConfig.flag(old), LoopKVConfig.flag(new)) for old, new in RENAMED.items()]
    assert page.count("\n# ") == 0 and page.startswith("# Configuration\n")
    for part, pipes in ((flags, 5), (renamed, 3)):  # every row has exactly its cells: no unescaped | inside one
        for line in part.splitlines():
            if line.startswith("| "):
                assert len(re.findall(r"(?<!\\)\|", line)) == pipes, line
    assert not re.search(r"(?<![\\`])<[a-z]", page), "raw HTML"
    assert config_docs.text("a | b <c> $x *y* --loopkv-x-y") == r"a \| b \<c\> \$x \*y\* `--loopkv-x-y`"
