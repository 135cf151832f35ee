"""Generate the docs' benchmark pages from the stored results: ``docs/benchmarks/<name>.md`` (with
its plot copied beside it) for each maintained benchmark, and ``docs/benchmarks/index.md``.

    python -m benchmarks.pages            # write the pages
    python -m benchmarks.pages --check    # exit 1 when a committed page differs from the results

Only ``benchmarks/results/<name>.{json,md,png}`` and the benchmarks' docstrings are read: nothing
is run, nothing imported beyond the registry. Whether a result is stale depends on later commits, so the page carries a
``bench-staleness`` directive (docs/_ext/bench_staleness.py) that decides it at build time."""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
from pathlib import Path

from benchmarks.harness.env import flags_summary, load1
from benchmarks.harness.registry import SPECS, Spec
from benchmarks.harness.results import RESULTS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def _minutes(s) -> str:
    return f"{s / 60:.0f} min" if s else "not recorded"


def method(name: str) -> str:
    """The benchmark module's docstring (what it measures and how), read without importing it."""
    src = (Path(__file__).resolve().parent / f"{name}.py").read_text()
    return (ast.get_docstring(ast.parse(src)) or "").strip()


def _body(md: str) -> tuple[str, str]:
    """(the report's first heading as a line of text, the rest with headings one level down)."""
    first, _, rest = md.partition("\n")
    rest = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", rest, flags=re.M)
    return first.removeprefix("# ").strip(), rest.strip() + "\n"


def page(spec: Spec, payload: dict, md: str) -> str:
    env = payload.get("env") or {}
    git = env.get("git") or {}
    commit = git.get("commit") or ""
    source = f" ({git['source']})" if git.get("source") else (" (work tree modified)" if git.get("dirty_files") else "")
    versions = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "sglang") if env.get(k)) or "not recorded"
    load = (
        f"{load1(env['loadavg_start']):.1f} at start, {load1(env['loadavg_end']):.1f} at end"
        if env.get("loadavg_start") is not None and env.get("loadavg_end") is not None
        else "not recorded"
    )
    cpu = env.get("cpu_model") or f"{env.get('machine', '?')} CPU (model not recorded)"
    heading, body = _body(md)
    rows = [
        ("Measured", env.get("when", "not recorded")),
        ("Commit", f"`{commit[:10]}`{source}" if commit else "not recorded"),
        (
            "Machine",
            f"{cpu}; {env.get('cpu_count') or env.get('cores') or '?'} cores, {env.get('torch_threads', '?')} torch threads",
        ),
        ("CPU flags", flags_summary(env)),
        ("Versions", versions),
        ("Load average", load),
        ("Wall time", _minutes(env.get("wall_s"))),
    ]
    return "\n".join(
        [
            f"# {spec.title}",
            "",
            spec.question,
            "",
            "```{bench-staleness}",
            f":commit: {commit}",
            f":paths: {' '.join(spec.paths)}",
            "```",
            "",
            "| | |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows),
            "",
            "The run:",
            "",
            "```bash",
            env.get("command") or spec.command,
            "```",
            "",
            f"Full run: `{spec.command}`" + (f"; short run: `{spec.quick}`" if spec.quick else "") + ". "
            f"Re-render the report and this page from the stored results, running nothing: "
            f"`python -m benchmarks.{spec.name} --report-only && python -m benchmarks.pages`.",
            "",
            "## Results",
            "",
            f"Report: {heading}",
            "",
            body,
            "## How it measures",
            "",
            f"From `benchmarks/{spec.name}.py`:",
            "",
            method(spec.name),
            "",
        ]
    )


def index(payloads: dict[str, dict]) -> str:
    rows = []
    for name, spec in SPECS.items():
        env = payloads[name].get("env") or {}
        rows.append(
            f"| [{spec.title}]({name}.md) | {spec.question} | `{spec.command}` | {_minutes(env.get('wall_s'))} | "
            f"{env.get('when', '?')[:10]} |"
        )
    names = "\n".join(f"{name}" for name in SPECS)
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "Each maintained benchmark answers one question, runs on the shared harness (`benchmarks/harness/`) and "
            "keeps one result, `benchmarks/results/<name>.{json,md,png}`; its page below is generated from that "
            "result (`python -m benchmarks.pages`) and says at build time whether later commits changed what it "
            "measures. Every benchmark takes `--out NAME` (write elsewhere than the canonical result) and "
            "`--report-only` (re-render the report from the stored JSON, running nothing); those with parts take "
            "`--parts`. Wall time is the stored run's own record (not recorded by older runs).",
            "",
            "| benchmark | question | command | wall time of the stored run | measured |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "One-off studies (a question measured once, its conclusion on a design-decision page) live in "
            "`benchmarks/studies/` with their results under `benchmarks/results/studies/`; they get no page here.",
            "",
            "```{toctree}",
            ":hidden:",
            "",
            names,
            "```",
            "",
        ]
    )


def render() -> dict[Path, bytes]:
    """Every generated file (path -> bytes), from the stored results."""
    out, payloads = {}, {}
    for name, spec in SPECS.items():
        payloads[name] = json.loads((RESULTS / f"{name}.json").read_text())
        md = (RESULTS / f"{name}.md").read_text()
        out[DOCS / f"{name}.md"] = page(spec, payloads[name], md).encode()
        png = RESULTS / f"{name}.png"
        if png.exists():
            out[DOCS / f"{name}.png"] = png.read_bytes()
    out[DOCS / "index.md"] = index(payloads).encode()
    return out


def stale_files() -> list[Path]:
    """The generated files whose committed copy differs (or is missing)."""
    return [p for p, b in render().items() if not p.exists() or p.read_bytes() != b]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when a page differs from what the results render")
    args = ap.parse_args()
    if args.check:
        bad = stale_files()
        for p in bad:
            print(f"out of date: {p} (run python -m benchmarks.pages)")
        sys.exit(1 if bad else 0)
    DOCS.mkdir(parents=True, exist_ok=True)
    for path, data in render().items():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        shutil.move(tmp, path)
    print(f"wrote {len(SPECS)} benchmark pages and the index under {DOCS}")


if __name__ == "__main__":
    main()
