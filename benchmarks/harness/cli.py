"""The command line every maintained benchmark shares, and the one path from a payload to its files.

    python -m benchmarks.<name> [--out NAME] [--parts P ...] [own flags]   # measure, write, render
    python -m benchmarks.<name> --report-only [--out NAME]                 # re-render md/png from JSON

``--report-only`` imports no kernels and starts nothing: it reads ``<out>.json``, lets the benchmark
recompute what it derives (its summary), and writes ``<out>.md`` and ``<out>.png`` again."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.env import environment, finish
from benchmarks.harness.results import RESULTS, folded_md, load, write_results


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's three functions. ``run(args, env)`` measures and returns the payload (the
    harness stores ``env``, finished, under ``payload["env"]`` unless the payload holds another record); ``report(payload)`` renders its
    markdown from the payload alone; ``plot(payload, path)`` draws its PNG. ``refresh(payload)``
    recomputes, in place, whatever is derived from the raw runs (the summary), before a report."""

    name: str
    run: Callable[[argparse.Namespace, dict], dict]
    report: Callable[[dict], str]
    plot: Callable[[dict, Path], None] | None = None
    refresh: Callable[[dict], None] | None = None
    parts: tuple[str, ...] = ()
    default_parts: tuple[str, ...] | None = None


def parser(bench: Benchmark, doc: str | None) -> argparse.ArgumentParser:
    """The shared flags; the benchmark adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", "--name", dest="out", default=bench.name,
                    help=f"results stem under benchmarks/results/ (default {bench.name})")  # fmt: skip
    ap.add_argument("--report-only", "--replot", dest="report_only", action="store_true",
                    help="re-render <out>.md and <out>.png from the stored <out>.json (runs nothing)")  # fmt: skip
    if bench.parts:
        default = list(bench.default_parts or bench.parts)
        ap.add_argument("--parts", nargs="+", choices=bench.parts, default=default,
                        help=f"what to run (default: {' '.join(default)})")  # fmt: skip
    return ap


def markdown(bench: Benchmark, out: str, payload: dict) -> str:
    """The report of ``payload`` as ``<out>.md`` holds it (the summary recomputed first, in place)."""
    if bench.refresh:
        bench.refresh(payload)
    md = bench.report(payload) + folded_md(payload)
    return md + (f"\n![{bench.name}]({Path(out).name}.png)\n" if bench.plot else "")


def render(bench: Benchmark, out: str, payload: dict) -> str:
    """Write ``<out>.json``/``.md``/``.png`` from ``payload``; returns the markdown."""
    md = markdown(bench, out, payload)
    write_results(out, payload, md)
    if bench.plot:
        bench.plot(payload, RESULTS / f"{out}.png")
    return md


def command(name: str, argv: list[str]) -> str:
    return " ".join([f"python -m benchmarks.{name}", *argv])


def main(bench: Benchmark, ap: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.report_only:
        md = render(bench, args.out, load(args.out))
        print(f"re-rendered {RESULTS / args.out}.md from its JSON ({len(md.splitlines())} lines)")
        return
    from benchmarks.common import prebuild_kernels

    prebuild_kernels()  # not inside the first server's timed start-up
    env = environment() | {"command": command(bench.name, argv)}
    payload = bench.run(args, env)
    if payload.get("env", env) is env:  # a run that adds a part to stored results keeps their record
        payload["env"] = finish(env)
    md = render(bench, args.out, payload)
    print(md)
    print(f"-> {RESULTS / args.out}.json")
