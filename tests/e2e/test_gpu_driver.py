"""Dry run of the GPU check's driver (benchmarks/gpu_server.py, issue 56) against CPU servers on tiny
random-weight models: every phase runs and the JSON summary holds the keys a GPU run reports. CPU
timings are not the GPU's: only float32 identity and the host-tier resume are asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server

KEYS = (
    "greedy_identical_full_budget",
    "tier_resume_identical",
    "resume_host_over_recompute_16k",
    "sparse_decode_tpot_speedup_32k_bs8",
    "dense_tpot_ratio_sglang_over_loopkv",
    "device",
)


# slow: the whole driver against several CPU servers (minutes); run with -m slow before a GPU session
@pytest.mark.slow
def test_driver_dry_run_writes_every_summary_key(default_model_dir, tmp_path):
    out = tmp_path / "gpu_server.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_server", "--dry-run", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "work"), "--tokenizer", str(default_model_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert all(summary[k] is not None for k in KEYS), summary
    assert summary["device"] == "cpu (dry run)"
    assert report["greedy_float32"]["identical"], report["greedy_float32"]
    assert report["resume"]["identical"] and report["resume"]["host_tokens"] > 0, report["resume"]
    assert report["sparse"]["lserve"]["sparse_steps"] > 0 and 0 < summary["sparse_decode_selected_fraction"] < 1


def test_driver_rejects_unknown_phases(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.gpu_server", "--phases", "greedy,warp", "--out", str(tmp_path / "x.json")]
    proc = subprocess.run(cmd + ["--tokenizer", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "warp" in proc.stderr
