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


class Checkpoint:
    """The finished pieces of a long run, by key, in ``benchmarks/results/.<name>.partial.json``
    (rewritten atomically after each piece), so a run that is killed resumes where it stopped
    (``resume=True``) instead of starting over. ``meta`` (what the pieces depend on: lengths,
    repeats, the commit) must match for stored pieces to be reused. :meth:`finish` removes the file."""

    def __init__(self, name: str, meta: dict, resume: bool) -> None:
        self.path = RESULTS / f".{name}.partial.json"
        self.meta = json.loads(json.dumps(meta))  # as it reads back
        stored = json.loads(self.path.read_text()) if resume and self.path.exists() else {}
        self.pieces: dict = stored.get("pieces", {}) if stored.get("meta") == self.meta else {}

    def get(self, key: str):
        return self.pieces.get(key)

    def put(self, key: str, value) -> None:
        self.pieces[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _atomic(self.path, json.dumps({"meta": self.meta, "pieces": self.pieces}))

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)
