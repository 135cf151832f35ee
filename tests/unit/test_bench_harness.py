"""The shared benchmark harness without a server: a toy benchmark through the command line (a run
writes JSON/markdown/plot with an environment record; ``--report-only`` re-renders from the JSON
alone), and the shared statistics."""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks.harness import cli, env, results
from benchmarks.harness.results import folded_md
from benchmarks.harness.stats import nearest_rank, percentile, ratio


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(cli, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "prebuild_kernels", lambda: 0.0)
    runs = []

    def run(args, env_rec):
        runs.append(args.parts)
        return {"summary": {}, "raw": [1.0, 3.0]}

    def refresh(p):
        p["summary"] = {"mean": sum(p["raw"]) / len(p["raw"])}

    def plot(p, path):
        path.write_bytes(b"png")

    bench = cli.Benchmark("toy", run, lambda p: f"# toy\n\nmean {p['summary']['mean']}\n", plot, refresh, ("a", "b"))
    return bench, tmp_path, runs


def test_a_run_writes_its_files_with_an_environment_record(toy):
    bench, out, runs = toy
    cli.main(bench, cli.parser(bench, None), ["--parts", "b", "--out", "toy_b"])
    p = json.loads((out / "toy_b.json").read_text())
    assert runs == [["b"]] and p["summary"] == {"mean": 2.0}
    e = p["env"]
    assert e["command"] == "python -m benchmarks.toy --parts b --out toy_b" and "t_start" not in e
    for key in ("when", "cpu_model", "cpu_flags", "cpu_count", "torch_threads", "torch", "loadavg_end", "wall_s"):
        assert key in e, key
    assert (out / "toy_b.md").read_text() == "# toy\n\nmean 2.0\n\n![toy](toy_b.png)\n"
    assert (out / "toy_b.png").read_bytes() == b"png"


def test_report_only_runs_nothing_and_follows_the_stored_json(toy):
    bench, out, runs = toy
    (out / "toy.json").write_text(json.dumps({"raw": [4.0], "env": {}}))
    cli.main(bench, cli.parser(bench, None), ["--report-only"])
    assert runs == [] and "mean 4.0" in (out / "toy.md").read_text()


def test_report_only_without_stored_results_says_so(toy):
    bench, _, _ = toy
    with pytest.raises(SystemExit, match="no stored results"):
        cli.main(bench, cli.parser(bench, None), ["--report-only", "--out", "missing"])


def test_unknown_part_is_refused(toy, capsys):
    bench, _, _ = toy
    with pytest.raises(SystemExit):
        cli.main(bench, cli.parser(bench, None), ["--parts", "c"])
    assert "invalid choice" in capsys.readouterr().err


def test_environment_helpers():
    assert env.load1([0.5, 1, 2]) == 0.5 and env.load1(0.7) == 0.7
    assert env.machine_label({"machine": "x86_64", "cpu_count": 2}) == "x86_64 CPU (2 cores)"
    assert env.machine_label({"machine": "x86_64"}) == "x86_64 CPU"
    assert env.flags_summary({"cpu_flags": {"avx2": True, "amx_bf16": False}}) == "avx2"


def test_folded_parts_are_listed_with_their_own_record():
    p = {
        "parts": {
            "four_workers": {"env": {"when": "2026-11-29", "command": "python -m x", "git": {"commit": "a" * 40}}}
        }
    }
    assert "| `parts.four_workers` | 2026-11-29 | aaaaaaaaaa | `python -m x` |" in folded_md(p)
    assert folded_md({}) == ""


def test_stats():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) != percentile([], 50)  # nan when empty
    assert nearest_rank([1, 2, 3, 4, 5], 0.9) == 5 and nearest_rank([], 0.5) is None
    assert ratio(1, 0) is None and ratio(None, 2) is None and ratio(3, 2) == 1.5


def test_a_checkpoint_keeps_finished_pieces_for_a_resumed_run_of_the_same_meta(toy):
    _, out, _ = toy
    meta = {"lengths": [2048, 4096], "commit": {"commit": "abc", "dirty_files": ""}}
    first = results.Checkpoint("long", meta, resume=False)
    first.put("a/host/2048", {"ttft_s": 0.5})  # then the run is killed
    assert results.Checkpoint("long", meta, resume=True).get("a/host/2048") == {"ttft_s": 0.5}
    assert results.Checkpoint("long", meta, resume=False).get("a/host/2048") is None  # a fresh run
    assert results.Checkpoint("long", meta | {"commit": "def"}, resume=True).get("a/host/2048") is None
    again = results.Checkpoint("long", meta, resume=True)
    again.finish()
    assert not (out / ".long.partial.json").exists()


def test_a_resumed_restore_piece_has_token_ids_as_keys_again():
    from benchmarks.restore import _int_token_keys

    piece = json.loads(json.dumps({"ttft_s": 1.0, "logprobs": {"top": {17: -0.1}, "chosen": {}}}))
    assert _int_token_keys(piece)["logprobs"] == {"top": {17: -0.1}, "chosen": {}}


def test_a_restore_ratio_pairs_the_rounds_and_falls_back_to_the_medians():
    from benchmarks.restore import paired_ratio

    # a slow round (the machine, not a system) slows both servers of a group alike: the paired
    # ratio sees 1.0 every round, the ratio of medians would not
    base = {"ttft_s": 0.11, "ttfts_s": [0.10, 0.20, 0.11]}
    other = {"ttft_s": 0.11, "ttfts_s": [0.10, 0.20, 0.11]}
    assert paired_ratio(base, other) == 1.0
    assert paired_ratio({"ttfts_s": [0.1, 0.3, 0.2]}, {"ttfts_s": [0.2, 0.3, 0.1]}) == 1.0  # median of 0.5, 1, 2
    assert paired_ratio({"ttft_s": 0.3, "ttfts_s": [0.3]}, {"ttft_s": 0.1, "ttfts_s": [0.1, 0.1]}) == pytest.approx(3.0)
    assert paired_ratio({"ttft_s": None}, other) is None
