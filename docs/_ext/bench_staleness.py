"""Sphinx directive ``bench-staleness``: marks a benchmark page stale when a commit after the
result's touched what the benchmark measures. Computed at build time from git history (never
stored in the page, which would go stale itself with every commit); without git, or without the
result's commit in a shallow clone, the page says staleness is unknown.

    ```{bench-staleness}
    :commit: <the commit the result was measured at>
    :paths: sgl_loopkv/cache/ benchmarks/restore.py
    ```
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective


def later_change(root: Path, commit: str, paths: list[str]) -> str | None:
    """``"<short hash> <date> <subject>"`` of the newest commit after ``commit`` that touched ``paths``;
    ``""`` when none did; None when git cannot tell (no repository, unknown commit)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)

    try:
        if not commit or git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
            return None
        top = git("rev-parse", "--show-toplevel").stdout.strip()
        log = git("-C", top, "log", "-1", "--format=%h %cs %s", f"{commit}..HEAD", "--", *paths)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if log.returncode:
        return None
    line = log.stdout.strip()
    return line if len(line) <= 90 else line[:87] + "..."


class BenchStaleness(SphinxDirective):
    option_spec = {"commit": directives.unchanged_required, "paths": directives.unchanged_required}

    def run(self) -> list[nodes.Node]:
        commit, paths = self.options.get("commit", ""), self.options.get("paths", "").split()
        later = later_change(Path(self.env.srcdir), commit, paths)
        if later is None:
            node, text = nodes.note(), "Staleness unknown: this build has no git history of the result's commit."
        elif later:
            node = nodes.warning()
            text = f"Stale: a later commit changed what this benchmark measures ({later}). Re-run it to refresh."
        else:
            node, text = nodes.note(), f"Current: no commit since {commit[:10]} changed what this benchmark measures."
        node += nodes.paragraph(text=text)
        return [node]


def setup(app):
    app.add_directive("bench-staleness", BenchStaleness)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
