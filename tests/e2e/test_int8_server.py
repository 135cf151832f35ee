"""int8 tiers in a real server (``--loopkv-tier-store-dtype int8``)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]  # int8 tiers are opt-in; the codec is unit-tested


def test_server_resumes_int8_histories_from_host_and_disk(tiny_server, tiny_model_dir, server_logs, tmp_path):
    """A real server with int8 tiers: evicted conversations come back from the host arena and, after a
    restart, from disk; the answers equal a server that never evicted (int8 error is far below the
    tiny model's logit gaps here); the host tier holds int8 bytes per token."""
    from benchmarks.common import metrics
    from sgl_loopkv.server.process import ServerProcess
    from tests.e2e.conftest import COMMON_SERVER_ARGS
    from tests.e2e.test_tiered_cache import N_CONV, ask, tiers

    reference = {i: ask(tiny_server.url, i)["output_ids"] for i in (0, N_CONV - 3)}
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "2048", "--enable-metrics", "--loopkv-tier-store-dtype", "int8"),
        *("--loopkv-tier-disk-dir", str(tmp_path)),
    ]
    with ServerProcess(args, log_path=server_logs / "int8-1.log").start() as srv:
        for i in range(N_CONV):
            ask(srv.url, i)
        host_hit = ask(srv.url, N_CONV - 3)
        assert tiers(host_hit)["host"] > 800, tiers(host_hit)
        assert host_hit["output_ids"] == reference[N_CONV - 3]
        m = metrics(srv.url)
        per_token = m['loopkv_tier_bytes{tier="host"}'] / m['loopkv_tier_tokens{tier="host"}']
    kv, summaries = 2 * 2 * 2 * (16 + 4), 2 * 2 * 2 * 16 * 2 / 16  # tiny model: 2 layers, 2 KV heads, dim 16; fp16
    assert per_token == pytest.approx(kv + summaries)
    with ServerProcess(args, log_path=server_logs / "int8-2.log").start() as srv:
        resumed = ask(srv.url, 0)
        assert tiers(resumed)["disk"] > 800, tiers(resumed)
        assert resumed["output_ids"] == reference[0]
