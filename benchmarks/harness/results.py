"""One writer and reader for ``benchmarks/results/<name>.{json,md,png}`` (writes atomic), and the
markdown table every report uses."""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load(name: str) -> dict:
    """The stored payload of results ``name``; a clear error when there is none."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"no stored results {path}: run the benchmark first")
    return json.loads(path.read_text())


def write_results(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """``<name>.json`` and ``<name>.md`` under benchmarks/results/ (``name`` may hold a folder)."""
    json_path, md_path = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic(json_path, json.dumps(payload, indent=2) + "\n")
    _atomic(md_path, markdown)
    return json_path, md_path


def md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def folded_md(payload: dict) -> str:
    """The earlier runs kept under ``payload["parts"]`` (one-off A/B runs whose numbers a design
    decision cites), one line each: key, date, commit and command of the run."""
    parts = payload.get("parts") or {}
    if not parts:
        return ""
    rows = []
    for key, p in parts.items():
        env = p.get("env") or p.get("environment") or {}
        commit = (env.get("git") or {}).get("commit") or (p.get("config") or {}).get("commit") or "not recorded"
        rows.append([f"`parts.{key}`", env.get("when", "?"), commit[:10], f"`{env.get('command', '?')}`"])
    return "\nEarlier runs kept in this file (their full records under `parts`):\n\n" + md_table(
        ["part", "when", "commit", "command"], rows
    )
