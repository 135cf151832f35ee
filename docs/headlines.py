"""Measured values in the README and the docs pages, read from ``benchmarks/results/<name>.json``.

A value is never typed: it sits between two markers that say where it comes from, and this script
rewrites what is between them::

    <!-- value restore summary.storage_reduction {:.2f}x -->3.37x<!-- /value -->

``restore`` names ``benchmarks/results/restore.json`` (``studies/x``: ``results/studies/x.json``); the key path walks the JSON (``a.b.c``; a key
holding a dot goes in brackets: ``summary.by_budget[0.1]``); the optional format is a
:meth:`str.format` pattern (default ``{}``). Pseudo-keys read the run's environment record (``env``,
or ``environment`` in older files): ``@date`` (the run's day), ``@machine`` (architecture and
cores), ``@cpu`` (the CPU's model and its widest matrix instructions: the kind a result holds on),
``@commit`` (short commit, when recorded).

    python docs/headlines.py            # rewrite the values in README.md and docs/**/*.md
    python docs/headlines.py --check    # exit 1 listing every value that differs from its file
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!-- value (?P<name>[\w./-]+) (?P<path>\S+)(?: (?P<fmt>[^>]*?))? -->(?P<text>.*?)<!-- /value -->")
_KEY = re.compile(r"\[([^\]]+)\]|([^.\[\]]+)")


class Value(NamedTuple):
    """One marker of one file: where it is, what it shows, what its results file says."""

    file: Path
    line: int
    spec: str
    shown: str
    expected: str


class HeadlineError(ValueError):
    """A marker names a results file, key or format that does not resolve."""


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _results(name: str) -> dict:
    return _load(RESULTS / f"{name}.json")


@cache
def _load(path: Path) -> dict:
    if not path.is_file():
        raise HeadlineError(f"no results file {_rel(path)}")
    return json.loads(path.read_text())


def _env(data: dict) -> dict:
    return data.get("env") or data.get("environment") or {}


def _pseudo(data: dict, key: str) -> Any:
    env = _env(data)
    if key == "@date":
        return str(env["when"])[:10]
    if key == "@machine":
        cores = env.get("cpu_count") or env.get("cores")
        return f"{env['machine']}, {cores} cores" if cores else env["machine"]
    if key == "@cpu":
        return cpu_kind(env)
    if key == "@commit":
        return (env.get("git") or {})["commit"][:10]
    raise KeyError(key)


def cpu_kind(env: dict) -> str:
    """``AMD EPYC, AVX512-BF16 without AMX``: the CPU a run recorded, by the instructions that set
    its kernels' paths (runs differ by CPU kind, docs/models.md)."""
    model = " ".join(str(env.get("cpu_model") or "").replace("(R)", "").replace("(TM)", "").split())
    if not model:
        raise KeyError("cpu_model")
    flags = env.get("cpu_flags") or {}
    if flags.get("amx_bf16"):
        isa = "AMX-BF16"
    elif flags.get("avx512_bf16"):
        isa = "AVX512-BF16 without AMX"
    elif flags.get("avx512f"):
        isa = "AVX-512 without bfloat16"
    else:
        isa = "AVX2" if flags.get("avx2") else "no AVX2"
    return f"{model}, {isa}"


def lookup(name: str, path: str) -> Any:
    """The value at ``path`` in ``benchmarks/results/<name>.json`` (see the module docstring)."""
    data = _results(name)
    try:
        if path.startswith("@"):
            return _pseudo(data, path)
        node: Any = data
        for bracketed, plain in _KEY.findall(path):
            node = node[bracketed or plain]
        return node
    except (KeyError, TypeError, IndexError) as e:
        raise HeadlineError(f"{name}.json has no {path!r} (missing: {e})") from None


def render(name: str, path: str, fmt: str | None) -> str:
    value = lookup(name, path)
    try:
        return (fmt or "{}").format(value)
    except (ValueError, TypeError) as e:
        raise HeadlineError(f"{name} {path}: format {fmt!r} does not fit {value!r} ({e})") from None


def default_files() -> list[Path]:
    pages = (p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *sorted(pages)]


def scan(files: list[Path]) -> list[Value]:
    """Every marker of ``files``; raises :class:`HeadlineError` (with file and line) when one does not resolve."""
    found = []
    for file in files:
        for lineno, line in enumerate(file.read_text().splitlines(), 1):
            for m in MARKER.finditer(line):
                spec = f"{m['name']} {m['path']}"
                try:
                    expected = render(m["name"], m["path"], m["fmt"])
                except HeadlineError as e:
                    raise HeadlineError(f"{_rel(file)}:{lineno}: {e}") from None
                found.append(Value(file, lineno, spec, m["text"], expected))
    return found


def rewrite(files: list[Path]) -> int:
    """Fill every marker of ``files`` from its results file; returns how many values changed."""
    changed = 0
    for file in files:
        text = file.read_text()

        def fill(m: re.Match) -> str:
            nonlocal changed
            value = render(m["name"], m["path"], m["fmt"])
            changed += value != m["text"]
            return m[0][: m.start("text") - m.start()] + value + "<!-- /value -->"

        new = MARKER.sub(fill, text)
        if new != text:
            file.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list values that differ from their results file")
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/**/*.md")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or default_files()
    try:
        if args.check:
            stale = [v for v in scan(files) if v.shown != v.expected]
            for v in stale:
                print(f"{_rel(v.file)}:{v.line}: {v.spec}: shows {v.shown!r}, results say {v.expected!r}")
            return 1 if stale else 0
        print(f"{rewrite(files)} value(s) updated")
    except HeadlineError as e:
        print(f"headlines: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
