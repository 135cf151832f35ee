"""``docs/configuration.md``, generated from the launcher's own parser (the one ``--help`` prints).

``python -m sgl_loopkv.server.config_docs`` prints the page; ``--write`` replaces the file (atomically).
``tests/unit/test_config_docs.py`` fails while the committed page differs from what this prints.
The page is MyST Markdown: one table per argument group under a label other pages link to
(``[](#configuration-sparse-decode)``, :func:`target`), then the renamed flags' old names
(:data:`~sgl_loopkv.config.RENAMED`); every character Markdown would read as
syntax escaped, and no raw HTML.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import sgl_loopkv
from sgl_loopkv.config import RENAMED, LoopKVConfig
from sgl_loopkv.flags import BYTES_HELP, Option
from sgl_loopkv.server.launch import loopkv_parser, sglang_defaults

PAGE = Path(sgl_loopkv.__file__).resolve().parent.parent / "docs" / "configuration.md"
COMMAND = "python -m sgl_loopkv.server.config_docs --write"
_FLAG = re.compile(r"(--[a-z][a-z0-9-]*[a-z0-9])")
_SYNTAX = re.compile(r"([\\`*_\[\]<>|$~{}#])")


def text(s: str) -> str:
    """Prose for a table cell: flags become code spans, Markdown syntax characters are escaped."""
    parts = _FLAG.split(" ".join(s.split()))
    return "".join(f"`{p}`" if i % 2 else _SYNTAX.sub(r"\\\1", p) for i, p in enumerate(parts))


def target(title: str) -> str:
    """The MyST label of a section (``configuration-host-and-disk-tiers``): other pages link to it."""
    return "configuration-" + re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def code(s: str) -> str:
    return f"`{s}`".replace("|", "\\|")


def option_row(o: Option) -> str:
    choices = o.choices()
    kind = "one of " + ", ".join(code(c) for c in choices) if choices is not None else o.type_name()
    shown = o.default_text()
    default = text(shown) if "default_text" in o.meta or o.switch else code(shown)
    return f"| {code(o.flag)} | {kind} | {default} | {text(o.meta['help'])} |"


def groups(parser: argparse.ArgumentParser) -> list[tuple[str, str, list[Option]]]:
    """(title, description, options) of each of the parser's sgl-loopkv groups, in ``--help`` order."""
    by_dest = {o.dest: o for o in LoopKVConfig.options()}
    out = []
    for group in parser._action_groups:  # argparse keeps its groups only here
        shown = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]  # not the old names
        options = [by_dest[a.dest] for a in shown if a.dest in by_dest]
        if options:
            title = group.title.removeprefix("sgl-loopkv ")
            out.append((title[0].upper() + title[1:], group.description or "", options))
    return out


def render() -> str:
    lines = [
        "# Configuration",
        "",
        f"% Generated from the launcher's parser by `{COMMAND}`; do not edit by hand.",
        "",
        "`python -m sgl_loopkv.launch_server` accepts every `sglang.launch_server` flag unchanged and adds the "
        "`--loopkv-*` flags below, one table per group of its `--help` (which lists SGLang's own flags after "
        "them). A flag given on the command line always wins over a default the launcher sets.",
        "",
        text(BYTES_HELP.replace("BYTES:", "Flags of type bytes take")),
        "",
    ]
    for title, description, options in groups(loopkv_parser(add_help=False)):
        lines += [f"({target(title)})=", f"## {title}", "", text(description), ""]
        lines += ["| Flag | Type | Default | Description |", "| --- | --- | --- | --- |"]
        lines += [option_row(o) for o in options] + [""]
    lines += [
        f"({target('SGLang flags')})=",
        "## SGLang flags the launcher sets",
        "",
        "Each is set only when the command line does not give it; `on`: a switch that is set, -: not set (SGLang's "
        "own default).",
        "",
        "| Flag | CPU | CPU with `--loopkv-stock` | GPU |",
        "| --- | --- | --- | --- |",
    ]
    for flag, values in sglang_defaults().items():
        cells = ["-" if v is None else text(v) if " " in v else code(v or "on") for v in values]
        lines.append(f"| {code(flag)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"({target('Renamed flags')})=",
        "## Renamed flags",
        "",
        "Every group's flags share one prefix; these had other names before. The old names still work (each sets "
        "the same value as its new name) but `--help` no longer lists them.",
        "",
        "| Old flag | New flag |",
        "| --- | --- |",
        *(f"| {code(LoopKVConfig.flag(old))} | {code(LoopKVConfig.flag(new))} |" for old, new in RENAMED.items()),
    ]
    return "\n".join(lines) + "\n"


def write(path: Path = PAGE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(render())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgl_loopkv.server.config_docs", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"replace {PAGE} instead of printing the page")
    if parser.parse_args(argv).write:
        write()
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
