"""Restoration in a real server: partial recompute + load gives the never-evicted greedy output, and
Krul's layer sharing stores paired layers as one row."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.server


# --- in a real server: partial recompute + load gives the never-evicted greedy output ------------
# recompute_all is the fixed split's far end (and unit-tested): -m slow
@pytest.mark.parametrize(
    "planner", [["fixed", "--loopkv-restore-ratio", "0.5"], pytest.param(["recompute_all"], marks=pytest.mark.slow)]
)
def test_server_restores_with_a_split_plan(planner, tiny_server, tiny_model_dir, server_logs, tmp_path):
    from benchmarks.common import metrics
    from sgl_loopkv.server.process import ServerProcess
    from tests.e2e.conftest import COMMON_SERVER_ARGS
    from tests.e2e.test_tiered_cache import N_CONV, ask, tiers

    reference = {i: ask(tiny_server.url, i)["output_ids"] for i in (0, N_CONV - 3)}
    log = server_logs / f"restore-{planner[0]}.log"
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "2048", "--enable-metrics"),
        *("--loopkv-tier-disk-dir", str(tmp_path), "--loopkv-tier-disk-bytes", "8000000"),
        *("--loopkv-tier-host-bytes", "2200000"),
        *("--loopkv-restore-planner", *planner),
    ]
    min_front = 800 if planner[0] == "recompute_all" else 400

    def resumed(i: int) -> dict:
        """Conversation i asked again: it was restored, with its first layer's front recomputed (the split
        really happened: the rest loaded, or skipped on disk)."""
        before = metrics(srv.url).get("loopkv_restores_total", 0.0)
        out = ask(srv.url, i)
        m = metrics(srv.url)
        assert m["loopkv_restores_total"] > before, (before, m["loopkv_restores_total"])
        assert m['loopkv_restore_last_front_tokens{layer="first"}'] >= min_front, m
        return out

    with ServerProcess(args, log_path=log).start() as srv:
        for i in range(N_CONV):
            ask(srv.url, i)
        host_hit = resumed(N_CONV - 3)
        assert tiers(host_hit)["host"] > 800, tiers(host_hit)
        assert host_hit["output_ids"] == reference[N_CONV - 3]
        time.sleep(1.0)  # let the disk writer finish
        disk_hit = resumed(0)
        assert tiers(disk_hit)["disk"] > 800, tiers(disk_hit)
        assert disk_hit["output_ids"] == reference[0]


def _host_bytes_per_token(url: str) -> float:
    from benchmarks.common import metrics

    m = metrics(url)
    return m['loopkv_tier_bytes{tier="host"}'] / m['loopkv_tier_tokens{tier="host"}']


# sharing is off by default and its codecs are unit-tested: both ratios run with -m slow
@pytest.mark.parametrize(
    "ratio", [pytest.param("0", marks=pytest.mark.slow), pytest.param("1", marks=pytest.mark.slow)]
)
def test_server_shares_layers_of_stored_turns(ratio, tiny_server, tiny_model_dir, server_logs):
    """r_l = 0: nothing shared, bytes per token of a full KV, answers exact. r_l = 1 (both layers of
    the tiny model, every layer a candidate) and bf16 tiers: one pair stored as one row in half the
    bytes per value (a quarter of the KV bytes), and the resumed conversation is served from the
    host tier."""
    from benchmarks.common import metrics
    from sgl_loopkv.server.process import ServerProcess
    from tests.e2e.conftest import COMMON_SERVER_ARGS
    from tests.e2e.test_tiered_cache import N_CONV, ask, tiers

    log = server_logs / f"share-{ratio}.log"
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "2048", "--enable-metrics"),
        *("--loopkv-share-layers", "reuse", "--loopkv-share-ratio", ratio, "--loopkv-share-gamma", "0"),
        *(["--loopkv-tier-store-dtype", "bfloat16"] if ratio == "1" else []),
    ]
    with ServerProcess(args, log_path=log).start() as srv:
        for i in range(N_CONV):
            ask(srv.url, i)
        per_token = _host_bytes_per_token(srv.url)
        shared = metrics(srv.url)["loopkv_shared_segments_total"]  # segments stored with pairs sharing a row
        again = ask(srv.url, 0)
        assert tiers(again)["host"] > 800, tiers(again)
    full = 2 * 2 * 2 * 16 * 4  # layers x K/V x kv heads x head_dim x fp32
    summaries = 2 * 2 * 2 * 16 * 4 / 16  # per-chunk min/max keys, per token (fp32; fp16 next to bf16 KV)
    if ratio == "0":
        assert not shared and per_token == pytest.approx(full + summaries)
        assert again["output_ids"] == ask(tiny_server.url, 0)["output_ids"]
    else:
        assert shared > 0 and per_token == pytest.approx(full / 4 + summaries / 2)
