"""The soak's core (benchmarks/soak.py) on the tiny model: 12 concurrent multi-turn conversations
against one sgl-loopkv server whose device pool holds a fraction of their histories, host and disk
tiers with small quotas; then every completed turn again, one at a time, on the session's tiny
server, which never saw them (the CI form of ``python -m benchmarks.soak --quick``, without stock
SGLang; the benchmark replays on a fresh server of the soak's flags, a second start)."""

from __future__ import annotations

import functools
import time

import pytest

from benchmarks import soak
from benchmarks.common import model_facts

DURATION_S = 10  # ~60 turns on the tiny model, each replayed after (the suite's 15-minute budget)
# 12 clients of 2-turn conversations: on a loaded 2-core CI machine each client still finishes a
# conversation and starts the next within the duration (32 clients of 3 turns did not); their KV
# (~250 tokens a conversation) outgrows the pool many times over, the host tier a few times, the disk
# tier (segment files with their headers) within the run. The benchmark runs 32 clients.
LOAD = soak.Load(conversations=12, turns=2, user_tokens=100, max_tokens=16)
TIERS = soak.Tiers(pool=1024, host_tokens=1024, disk_tokens=4096)
# the tiny model's pool + host quota are ~1 MB, below the drift of three Python processes' heaps
# over a minute; so the RSS check here catches gross growth only (e.g. a pool-sized restore buffer
# kept per resume), the benchmark on SmolLM2 (quotas of hundreds of MB, no slack) the rest
RSS_SLACK_BYTES = 32 << 20


@pytest.mark.server
def test_soak_core(tiny_model_dir, server_logs, tiny_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    kv = model_facts(tiny_model_dir).kv_bytes_per_token(4)  # float32 pool
    flags = ["--model-path", str(tiny_model_dir), "--dtype", "float32"]
    t0 = time.monotonic()
    res = soak.run_system(
        "loopkv", flags, LOAD, TIERS, DURATION_S, tok, kv, check_answers=False, sample_s=1.0,
        rss_slack_bytes=RSS_SLACK_BYTES, log_path=server_logs / "soak.log", progress=lambda _: None,
    )  # fmt: skip
    log_at = tiny_server.log_path.stat().st_size
    count = functools.cache(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]))
    res["replay"] = soak.replay(tiny_server.url, LOAD, res["turns"], tok, count)
    res["replay"]["server_tracebacks"] = soak.log_tracebacks(tiny_server.log_path, log_at)
    s = soak.system_summary(res)
    print(f"soak core: {time.monotonic() - t0:.0f} s wall", {k: v for k, v in s.items() if k != "mismatches"})

    assert s["errors"] == 0, (res["errors"][:3], (res.get("replay") or {}).get("errors", [])[:3])
    assert s["conversations_started"] > LOAD.conversations, "no client got past its first conversation"
    tiers = s["cached_tokens_by_tier"]
    assert tiers.get("host", 0) + tiers.get("storage", 0) > 0, f"no turn resumed from a tier: {tiers}"
    assert s["max_disk_bytes"] > 0
    assert s["answers_identical"], res["replay"]["mismatches"][:3]
    assert s["disk_within_quota"], (s["max_disk_bytes"], s["disk_quota_bytes"])
    assert s["host_within_quota"], (s["max_host_tier_bytes"], s["host_quota_bytes"])
    assert s["rss_within_quota"], (s["max_rss_bytes"], s["rss_quota_bytes"], s["rss_baseline_bytes"])
