"""Chunk-pruned re-prefill in a real server (tiny model): a disk hit streamed period by period at
budget 1.0 gives the full load's greedy output; under a budget the history's chunks are read only
where the new turn looks, the turn is stored, and the conversation goes on."""

from __future__ import annotations

import math
import time

import pytest
import requests

from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS

pytestmark = pytest.mark.server


def prefix_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("loopkv_prefix_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def server(tiny_model_dir, disk_dir, log, *flags) -> ServerProcess:
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "2048", "--enable-metrics"),
        *("--loopkv-tier-host-bytes", "2200000", "--loopkv-tier-disk-dir", str(disk_dir)),
        *("--loopkv-tier-disk-bytes", "8000000"),
        *("--loopkv-prefix-min-tokens", "256", *flags),
    ]
    return ServerProcess(args, log_path=log)


# slow (30 s): the default suite checks budget 1.0 in-process (the backend over a full page cache equals
# dense attention over the stored history: tests/unit/test_prefix_prune.py) and runs the pruned server below
@pytest.mark.slow
def test_streamed_disk_resume_at_full_budget_equals_the_full_load(tiny_server, tiny_model_dir, server_logs, tmp_path):
    from tests.e2e.test_tiered_cache import N_CONV, ask, tiers

    reference = {i: ask(tiny_server.url, i)["output_ids"] for i in (0, N_CONV - 3)}
    log = server_logs / "prefix-stream.log"
    # freekv on: at budget 1.0 every chunk is kept, so its decode re-selection never changes a thing
    with server(
        tiny_model_dir, tmp_path, log, "--loopkv-prefix-stream", "--loopkv-decode-policy", "freekv"
    ).start() as srv:
        for i in range(N_CONV):
            ask(srv.url, i)
        host = ask(srv.url, N_CONV - 3)
        assert tiers(host)["host"] > 800, tiers(host)
        assert host["output_ids"] == reference[N_CONV - 3]
        time.sleep(1.0)  # the disk writer
        m0 = prefix_metrics(srv.url)
        hit = ask(srv.url, 0)
        assert tiers(hit)["disk"] > 800, tiers(hit)
        assert hit["output_ids"] == reference[0]
        m = prefix_metrics(srv.url)
    # both resumes (host and disk) went through the chunk reader
    assert m["loopkv_prefix_restores_total"] >= 2 and m0["loopkv_prefix_restores_total"] >= 1, (m0, m)
    used, read = (
        m[f'loopkv_prefix_bytes_total{{part="{p}"}}'] - m0[f'loopkv_prefix_bytes_total{{part="{p}"}}']
        for p in ("used", "disk_read")
    )
    assert used > 0 and m["loopkv_prefix_kept_fraction"] == 1.0
    # every chunk byte read from disk was used (no probe reads, no unused prefetch at budget 1.0), and
    # nothing else: at budget 1.0 no chunk is scored, so admission reads no key summaries
    assert read == used, (read, used)


# slow (a server of its own): pruned re-prefill is opt-in; its reads, selection and exactness are
# tests/unit/test_prefix_prune.py's
@pytest.mark.slow
def test_pruned_resume_reads_a_quarter_and_the_conversation_goes_on(tiny_server, tiny_model_dir, server_logs, tmp_path):
    """Budget 0.25: a quarter of the chunks read (from disk, each read chunk-aligned; from the host
    tier), the pruned turn stored for the next one; a damaged segment is detected when read, never
    attended, removed, and the conversation recomputed exactly next time."""
    import json

    from transformers import AutoTokenizer

    from sgl_loopkv.cache.layout import PREAMBLE_BYTES, KVGeometry, SegmentFileLayout, align_up
    from tests.e2e.test_tiered_cache import N_CONV, ask, files_of, tiers

    q1, q2 = "How many lamps are in room 2?", "How many cups are in room 8?"
    reference = {1: ask(tiny_server.url, 1, q1)["output_ids"], 2: ask(tiny_server.url, 2, q2)["output_ids"]}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    log = server_logs / "prefix-pruned.log"
    # freekv with tau > 1: every decode step re-selects each period's chunks and recalls what changed
    flags = ("--loopkv-prefix-budget", "0.25", "--loopkv-decode-policy", "freekv", "--loopkv-decode-tau", "2")
    with server(tiny_model_dir, tmp_path, log, *flags).start() as srv:
        for i in range(N_CONV + 1):  # the host tier holds the last ~4: 0, 1 and 2 are on disk only
            ask(srv.url, i)
        time.sleep(1.0)
        first = ask(srv.url, 0, "How many cups are in room 5?")  # from disk
        assert tiers(first)["disk"] > 800, tiers(first)
        pruned = first["meta_info"]["cached_tokens_details"]["pruned"]
        assert 0.25 <= pruned["kept_fraction"] < 0.35, pruned
        # chunk-aligned reads: every chunk byte read from disk was loaded (at the prefill, then recalled by
        # decode re-selections, one per generated token after the first); admission read headers and summaries
        assert 0 < pruned["bytes_loaded"] < pruned["disk_bytes_read"] < 1.5 * pruned["bytes_loaded"], pruned
        assert pruned["bytes_used"] <= pruned["bytes_loaded"] and pruned["decode_selections"] >= 11, pruned
        # the device held a page cache of a quarter of the history's chunks, not the history
        assert pruned["device_tokens"] == math.ceil(0.25 * (tiers(first)["disk"] // 16)) * 16, pruned
        host = ask(srv.url, N_CONV - 1, "How many books are in room 4?")  # from the host tier
        assert tiers(host)["host"] > 800, tiers(host)
        assert host["meta_info"]["cached_tokens_details"]["pruned"]["disk_bytes_read"] == 0
        m = prefix_metrics(srv.url)
        assert 0.25 <= m["loopkv_prefix_kept_fraction"] < 0.35
        # the pruned turn was stored: asked again, the same prompt finds the history and that turn
        again = ask(srv.url, 0, "How many cups are in room 5?")
        assert sum(tiers(again).values()) > sum(tiers(first).values()), (tiers(first), tiers(again))

        # conversation 1: one byte flipped in every layer-0 extent: admitted (header and summaries
        # intact), then caught when a kept extent is read; never attended; the segment goes
        (f1,) = files_of(tmp_path, tok, 1)
        raw = bytearray(f1.read_bytes())
        hlen = int.from_bytes(raw[8:12], "little")
        header = json.loads(raw[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen])
        layout = SegmentFileLayout(
            KVGeometry.from_json(header["geometry"]),
            header["n_chunks"],
            align_up(PREAMBLE_BYTES + hlen),
            group=header["layer_group"],
        )
        for j in range(header["n_chunks"]):
            raw[layout.extent_offset(0, j) + 5] ^= 0x5A
        f1.write_bytes(bytes(raw))
        hurt = ask(srv.url, 1, q1)
        assert hurt["meta_info"]["cached_tokens_details"]["pruned"]["bad_extents"] >= 1
        assert prefix_metrics(srv.url)["loopkv_prefix_bad_extents_total"] >= 1
        healed = ask(srv.url, 1, q1)  # the damaged segment is gone: recomputed, exactly
        assert tiers(healed)["disk"] == 0 and healed["output_ids"] == reference[1], tiers(healed)
        # conversation 2: truncated after its header: refused at admission (its summaries fail), recomputed
        (f2,) = files_of(tmp_path, tok, 2)
        raw = f2.read_bytes()
        f2.write_bytes(raw[: align_up(PREAMBLE_BYTES + int.from_bytes(raw[8:12], "little")) + 100])
        cut = ask(srv.url, 2, q2)
        assert tiers(cut)["disk"] == 0 and cut["output_ids"] == reference[2], tiers(cut)
        assert requests.get(f"{srv.url}/health", timeout=30).status_code == 200
        # first, host and again at least (hurt is admitted, then its damaged extents are left out)
        assert prefix_metrics(srv.url)["loopkv_prefix_restores_total"] >= 3
