"""The benchmark pages and reports as generated artefacts: each committed page must equal what its
stored result renders, each report what ``--report-only`` renders, and the staleness check must
tell a current result from a stale one (no server, no measurement)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import pages
from benchmarks.harness import cli
from benchmarks.harness.registry import SPECS
from benchmarks.harness.results import RESULTS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import bench_staleness  # noqa: E402


def test_committed_pages_match_the_results():
    assert pages.stale_files() == [], "run python -m benchmarks.pages and commit docs/benchmarks/"


@pytest.mark.parametrize("name", list(SPECS))
def test_report_only_renders_the_committed_report(name):
    bench = importlib.import_module(f"benchmarks.{name}").BENCH
    payload = json.loads((RESULTS / f"{name}.json").read_text())
    assert cli.markdown(bench, name, payload) == (RESULTS / f"{name}.md").read_text()


@pytest.mark.parametrize("name", list(SPECS))
def test_every_result_records_its_command_and_commit(name):
    env = json.loads((RESULTS / f"{name}.json").read_text())["env"]
    assert env["command"].startswith(f"python -m benchmarks.{name}")
    assert len(env["git"]["commit"]) == 40


def test_a_page_has_one_title_and_no_raw_second_level_heading_from_the_report():
    md = (RESULTS / "cluster.md").read_text()
    assert "\n## " in md  # the report has its own sections...
    text = pages.page(SPECS["cluster"], json.loads((RESULTS / "cluster.json").read_text()), md)
    assert [ln for ln in text.splitlines() if ln.startswith("# ")] == ["# Cluster"]
    assert [ln for ln in text.splitlines() if ln.startswith("## ")] == [
        "## Results",
        "## How it measures",
    ]  # ...one down


def _git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="no git checkout")
def test_staleness_tells_current_from_stale(tmp_path):
    head = _git("rev-parse", "HEAD")
    assert bench_staleness.later_change(ROOT, head, ["benchmarks/"]) == ""  # nothing after HEAD
    first = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    assert bench_staleness.later_change(ROOT, first, ["benchmarks/"])  # benchmarks/ changed since the first commit
    assert bench_staleness.later_change(ROOT, "0" * 40, ["benchmarks/"]) is None  # unknown commit
    assert bench_staleness.later_change(tmp_path, head, ["benchmarks/"]) is None  # no repository
