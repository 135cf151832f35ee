"""Chunk-pruned re-prefill without a server: the chunk selection's contract (property tests), the
restore's reads from the host tier and from verified disk extents, period reuse and prefetch, and
damaged extents that never reach a plan."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_loopkv.cache.layout import key_summaries
from sgl_loopkv.cache.pruned import ChunkReader, KVBuffers, PrunedHistory, PrunedParams, PrunedRestore, Source
from sgl_loopkv.cache.segment_record import CorruptSegment
from sgl_loopkv.kernels import chunk_io
from sgl_loopkv.selection.chunks import (
    always_kept,
    chunk_scores,
    keep_count,
    select_chunks,
    select_tokens,
    token_scores,
)
from tests.restores import (
    GEO,
    C,
    D,
    H,
    L,
    check_layer,
    decode_steps,
    disk_source,
    kv_of,
    restore,
    run_prefill,
    stored_segment,
)


# --- selection ----------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 200), st.floats(0.01, 1.0), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_selection_keeps_the_budget_the_first_and_the_nearest_chunks(m, budget, local, seed):
    scores = torch.rand(m, generator=torch.Generator().manual_seed(seed))
    keep = keep_count(m, budget)
    chunks = select_chunks(scores, keep, local)
    assert len(chunks) == keep <= max(2, math.ceil(budget * m - 1e-9)) and keep <= m  # budget rounded up to chunks
    assert chunks.tolist() == sorted(set(chunks.tolist()))
    assert 0 in chunks.tolist() and m - 1 in chunks.tolist()
    nearest = min(local, keep - 1) if m > keep else m
    assert set(range(m - max(nearest, 1), m)) <= set(chunks.tolist())


def test_scores_find_the_chunk_that_holds_the_queried_key():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(40 * C, H, D, generator=g) * 0.1
    q = torch.randn(3, 2 * H, D, generator=g)
    k[17 * C + 5] = q[:, ::2].mean(0) * 4  # chunk 17 holds a key close to every query head of group 0
    scores = chunk_scores(q, key_summaries(k[None], C)[0], 1.0, C)
    assert torch.isclose(scores.sum(), torch.tensor(1.0)) and int(scores.argmax()) == 17


@pytest.mark.parametrize("copy", ["slots", "pages-torch", "pages-native"])
def test_host_restore_loads_only_kept_chunks_bit_exactly_and_reuses_a_set_per_period(copy, monkeypatch):
    native = chunk_io.load()
    if copy == "pages-native" and native is None:
        pytest.skip("no C++ compiler for the chunk_io extension")
    calls = []

    class Spy:  # the native copier, counted; None: the torch gather-and-copy path
        def copy_spans(self, spans, nbytes):
            calls.append(len(spans))
            native.copy_spans(spans, nbytes)

    monkeypatch.setattr(chunk_io, "load", lambda: Spy() if copy == "pages-native" else None)
    # the host tier's view of a node: a token range of a longer segment (its rows strided, not contiguous)
    kv = kv_of(0, 24)[:, :, 2 * C : 22 * C]
    job, pk, pv = restore([Source("s", 2, 22, 0, host_kv=kv)], kv, budget=0.3, period=3, paged=copy != "slots")
    run_prefill(job)
    # natively: a span per loaded chunk's K and one per its V (each layer's); otherwise none
    spans = 2 * job.account().bytes_loaded // job.layer_bytes
    assert spans > 0 and sum(calls) == (spans if copy == "pages-native" else 0)
    assert job.cache_tokens == keep_count(20, 0.3) * C  # the device holds the kept chunks, not the history
    for layer in range(L):
        pos = check_layer(job, pk, pv, kv, layer)
        assert len(pos) == keep_count(20, 0.3) * C
        if layer % 3:  # one selection per period: every layer of it reads the same chunks
            assert torch.equal(pos, job.kept_positions(layer - layer % 3))
    outside = torch.ones(4096, dtype=torch.bool)
    outside[job.slots] = False  # nothing is written outside the page cache
    assert all(torch.isnan(pk[layer][outside]).all() for layer in range(L))
    st = job.account()
    assert st.bytes_used == sum(len(job.kept_positions(x)) for x in range(L)) // C * job.layer_bytes
    assert st.prefetched_bytes > 0 and st.wasted_prefetch_bytes <= st.prefetched_bytes
    assert st.overlaps == 1 and 0.0 <= st.inter_period_overlap <= 1.0  # two periods of 3 layers: one overlap
    job.close()


def test_native_host_copy_refuses_spans_outside_its_tensors():
    if chunk_io.load() is None:
        pytest.skip("no C++ compiler for the chunk_io extension")
    kv = kv_of(0, 20)
    job, pk, _ = restore([Source("s", 0, 20, 0, host_kv=kv)], kv, budget=0.3, period=3, paged=True)
    to = job.slots.view(-1, C)[:2]
    with pytest.raises(IndexError):  # a chunk past the host rows: never a raw read beyond them
        job.loads.copy_host(kv[0, :, : 4 * C], 0, torch.tensor([1, 4]), to)
    assert job.loads.copy_host(kv[0], 0, torch.tensor([1, 4]), to)
    assert torch.equal(pk[0][to.flatten()], kv[0, 0].view(-1, C, H, D)[[1, 4]].flatten(0, 1))
    job.close()


@pytest.mark.parametrize("prefetch", [0.0, 0.5, 1.0])
def test_prefetch_reads_ahead_the_always_kept_then_the_best_scored_share(prefetch):
    """``prefetch`` of a period's set is read ahead for the next: the first and nearest chunks always
    (kept again whatever the scores: never wasted), then the best scored; what every layer attends
    to is still exactly its kept chunks' stored KV."""
    kv = kv_of(7, 40)
    job, pk, pv = restore([Source("s", 0, 40, 0, host_kv=kv)], kv, budget=0.3, period=3, prefetch=prefetch)
    q = torch.randn(5, 2 * H, D, generator=torch.Generator().manual_seed(1))
    chunks = job.select(0, q, 0.3)
    ahead = torch.nonzero(job.prefetched[3]).flatten()  # read ahead for period 1 (layers 3..5)
    forced = torch.nonzero(always_kept(40, job.keep, 2)).flatten()
    assert torch.isin(forced, ahead).all() and torch.isin(ahead, chunks).all()
    assert len(ahead) == max(len(forced), round(prefetch * len(chunks)))  # 2 x 12 - 40 < 0: no floor
    scores = chunk_scores(q, job.summaries[0], 0.3, C)
    rest = chunks[~torch.isin(chunks, forced)]
    if 0 < len(ahead) - len(forced) < len(rest):  # the best scored of the rest, none worse left behind
        assert scores[ahead[~torch.isin(ahead, forced)]].min() >= scores[rest[~torch.isin(rest, ahead)]].max()
    run_prefill(job)
    for layer in range(L):
        check_layer(job, pk, pv, kv, layer)
    st = job.account()
    assert st.prefetched_bytes >= len(ahead) * 3 * job.layer_bytes
    if prefetch == 0.0:
        assert st.wasted_prefetch_bytes == 0  # only the always-kept chunks were read ahead
    job.close()


@pytest.mark.parametrize("budget", [0.5, 0.75, 0.9])
def test_a_large_set_reads_ahead_at_least_what_the_next_period_must_share_with_it(budget):
    """Two sets of ``keep`` out of ``n`` chunks share at least 2 keep - n: that many of the best
    scored are read ahead whatever ``prefetch`` says (none at budget 0.5), and every layer still
    attends to exactly its kept chunks' stored KV."""
    kv = kv_of(7, 40)
    job, pk, pv = restore([Source("s", 0, 40, 0, host_kv=kv)], kv, budget=budget, period=3, prefetch=0.0)
    chunks = job.select(0, torch.randn(5, 2 * H, D, generator=torch.Generator().manual_seed(1)), 0.3)
    ahead = torch.nonzero(job.prefetched[3]).flatten()
    forced = torch.nonzero(always_kept(40, job.keep, 2)).flatten()
    assert len(ahead) == max(len(forced), 2 * job.keep - 40) and torch.isin(ahead, chunks).all()
    run_prefill(job)
    for layer in range(L):
        check_layer(job, pk, pv, kv, layer)
    st = job.account()
    assert st.wasted_prefetch_bytes <= st.prefetched_bytes
    job.close()


def test_compute_wait_is_the_reads_waiting_for_the_next_selection_during_the_prefill():
    """A forward that takes 0.2 s before its second period's selection: the reads of the first
    period are done long before, so the restore's compute wait holds that time (and its I/O wait
    does not); a decode-time re-selection afterwards adds nothing to it."""
    import time

    kv = kv_of(3, 20)
    job, pk, pv = restore([Source("s", 0, 20, 0, host_kv=kv)], kv, budget=0.3, period=3, prefetch=0.0)
    q = torch.randn(5, 2 * H, D, generator=torch.Generator().manual_seed(1))
    job.select(0, q, 0.3)
    for layer in range(3):
        job.wait(layer)
    time.sleep(0.2)  # the forward computes layers 0-2 while the reader has nothing queued
    job.select(3, q, 0.3)
    for layer in range(3, L):
        job.wait(layer)
    job.settle()
    waited = job.account().compute_wait_s
    assert 0.15 <= waited < 1.0, waited
    time.sleep(0.1)
    job.decode_select(0, q[:1] * -1, 0.3, tau=2.0, serial=True)  # a recall: not a prefill wait
    job.settle()
    assert job.account().compute_wait_s == waited
    job.close()


# --- the IMPRESS-style baseline ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.floats(0.01, 1.0), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_token_selection_keeps_the_budget_and_reads_whole_blocks_around_it(m, budget, local, seed):
    T = m * C
    scores = torch.rand(T, generator=torch.Generator().manual_seed(seed))
    want = math.ceil(budget * T - 1e-9)
    mask, read = select_tokens(scores, want, C, local, 4 * C)
    forced = always_kept(m, max(2, -(-want // C)), local).repeat_interleave(C)
    assert int(mask.sum()) == min(T, max(want, int(forced.sum())))  # the budget in tokens (the forced ones above it)
    assert mask[forced].all()
    others = ~mask & ~forced
    if others.any() and (mask & ~forced).any():  # the best scored, none better left out
        assert scores[mask & ~forced].min() >= scores[others].max()
    touched = mask.view(m, C).any(1)
    assert touched[read].any() or not touched.any()
    for b in range(0, m, 4):  # a block is read whole or not at all, and read when it holds a kept token
        blk = torch.arange(b, min(b + 4, m))
        assert bool(torch.isin(blk, read).all()) == bool(touched[blk].any())
        assert not torch.isin(blk, read).any() or torch.isin(blk, read).all()


def test_token_scores_are_the_exact_attention_mass():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 2 * H, D, generator=g), torch.randn(5 * C, H, D, generator=g)
    ref = torch.softmax(torch.einsum("nhd,thd->nht", q, k.repeat_interleave(2, dim=1)) * 0.3, dim=-1).mean((0, 1))
    assert torch.allclose(token_scores(q, k, 0.3), ref, atol=1e-6)
    valid = torch.ones(5 * C, dtype=torch.bool)
    valid[C : 2 * C] = False
    s = token_scores(q, k, 0.3, valid)
    assert s[C : 2 * C].eq(0).all() and torch.isclose(s.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_impress_restore_probes_every_key_then_attends_to_the_chosen_tokens_only(tmp_path, tier, impress_registered):
    """The baseline reads the whole history at each period's first layer (its probe), keeps the tokens
    of highest exact mass, reads their 64-token blocks for the other layers; every layer attends to
    exactly the chosen tokens' stored KV, and what it read beyond them is its read amplification."""
    if tier == "disk":
        store, rec, kv = stored_segment(tmp_path, seed=9, chunks=24)
        sources, disk = [disk_source(store, rec)], store
    else:
        kv, disk = kv_of(9, 24), None
        sources = [Source("s", 0, 24, 0, host_kv=kv)]
    job, pk, pv = restore(sources, kv, budget=0.1, period=3, disk=disk, selection="impress")
    assert job.cache_tokens == 24 * C  # its cache spans the history
    q = torch.randn(5, 2 * H, D, generator=torch.Generator().manual_seed(1))
    run_prefill(job)
    want = math.ceil(0.1 * 24 * C - 1e-9)
    for layer in range(L):
        pos = check_layer(job, pk, pv, kv, layer)
        p = layer // 3
        chosen = job.selection.kept_tokens[p]
        assert torch.equal(pos, torch.nonzero(chosen).flatten())  # the chosen tokens, nothing else
        assert len(pos) == max(want, 3 * C)  # the budget (first + 2 nearest chunks forced)
        if layer % 3 == 0:  # the probe: every chunk of the period's first layer was read
            assert job.loaded[layer].all()
        else:  # the other layers: whole blocks around the chosen tokens, not the history
            read = torch.nonzero(job.loaded[layer]).flatten()
            assert torch.equal(read, job.kept[p]) and len(read) < 24 and len(read) % 4 == 0
    probe = token_scores(q, kv[0, 0], 0.3)  # period 0 chose by exact mass of layer 0's keys
    mask, _ = select_tokens(probe, want, C, 2, 4 * C)
    assert torch.equal(mask, job.selection.kept_tokens[0])
    st = job.account()
    assert st.bytes_used == sum(len(job.kept_positions(x)) for x in range(L)) * job.layer_bytes // C
    assert st.bytes_loaded > 2 * st.bytes_used  # probe + block padding: IMPRESS's read amplification
    if tier == "disk":
        assert st.disk_bytes_read == st.bytes_loaded
    job.close()


def test_budget_one_keeps_every_chunk():
    kv = kv_of(1, 9)
    job, pk, pv = restore([Source("s", 0, 9, 0, host_kv=kv)], kv, budget=1.0)
    run_prefill(job)
    for layer in range(L):
        assert torch.equal(check_layer(job, pk, pv, kv, layer), torch.arange(9 * C))
    job.close()


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("paged", [False, True], ids=["slots", "pages"])
def test_disk_restore_reads_kept_chunks_verified_and_bit_identical(tmp_path, group, paged):
    """Any file grouping gives the same KV, copied into the pool slot by slot or page by page; a
    file grouped by the restore's gate reads each run of selected chunks once per gate
    (layer-major: once per layer)."""
    store, rec, kv = stored_segment(tmp_path, group=group)
    job, pk, pv = restore(
        [disk_source(store, rec)], kv, budget=0.25, period=4, gate=2, disk=store, prefetch=0.0, paged=paged
    )
    run_prefill(job)
    for layer in range(L):
        check_layer(job, pk, pv, kv, layer)
    st = job.account()
    # chunk-aligned reads: what was read is what was loaded (extents carry no padding at this geometry)
    assert st.disk_bytes_read == st.bytes_loaded and st.bytes_used <= st.bytes_loaded
    assert st.disk_bytes_read < L * 12 * job.layer_bytes  # pruned: not the whole history
    asked = job.asked.int()
    per_layer_runs = sum(int((asked[x, 1:] > asked[x, :-1]).sum()) + int(asked[x, 0]) for x in range(L))
    if group == 1:
        assert store.codec.reads == per_layer_runs
    elif group == 2:  # the restore's gate: every layer pair's runs in one read each
        assert store.codec.reads == per_layer_runs // 2
    job.close()


def test_disk_reads_are_hinted_to_the_kernel_exactly_and_before_they_are_made(tmp_path, monkeypatch):
    """Every disk read of a restore is announced first (``WILLNEED`` on exactly its byte range, all
    of a selection's reads before the first of them), and the hints change nothing that is read."""
    store, rec, kv = stored_segment(tmp_path, group=2)
    log = []
    real_advise, real_preadv = os.posix_fadvise, os.preadv
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, off, n, how: log.append(("hint", off, n, how)) or real_advise(fd, off, n, how)
    )

    def preadv(fd, bufs, off):
        log.append(("read", off, sum(memoryview(b).nbytes for b in bufs), None))
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    job, pk, pv = restore([disk_source(store, rec)], kv, budget=0.25, period=4, gate=2, disk=store, prefetch=0.0)
    run_prefill(job)
    job.settle()
    for layer in range(L):
        check_layer(job, pk, pv, kv, layer)
    hints = [(off, n) for kind, off, n, how in log if kind == "hint" and how == os.POSIX_FADV_WILLNEED]
    reads = [(off, n) for kind, off, n, _ in log if kind == "read"]
    assert reads and sorted(hints) == sorted(reads)  # exactly the reads' ranges, each once
    for i, (kind, off, n, _) in enumerate(log):
        if kind == "read":
            assert ("hint", off, n, os.POSIX_FADV_WILLNEED) in log[:i]
    job.close()


def test_admission_reads_only_the_scored_layers_summaries_each_verified(tmp_path):
    """A restore scores chunks at each period's first layer only: admission reads those layers'
    summaries (a fraction of the block), each layer checked by its own crc32; a file written before
    per-layer checksums is read and verified whole."""
    import json
    import struct

    from sgl_loopkv.cache.layout import PREAMBLE_BYTES

    store, rec, kv = stored_segment(tmp_path, seed=5, chunks=8)
    whole = key_summaries(kv[:, 0], C)
    fd, header = store.open_for_chunks(rec.seg_id)
    before = store.bytes_read
    part = store.codec.read_summaries(fd, rec.seg_id, [0, 2], header)
    assert torch.equal(part, whole[[0, 2]].to(GEO.summary_dtype))
    assert store.bytes_read - before == 2 * 8 * GEO.summary_bytes_per_chunk_layer  # 2 of L layers
    none = store.codec.read_summaries(fd, rec.seg_id, [], header)  # budget 1.0 scores nothing: reads nothing
    assert (
        none.shape == (0, *whole.shape[1:]) and store.bytes_read - before == 2 * 8 * GEO.summary_bytes_per_chunk_layer
    )
    os.close(fd)

    path = next(tmp_path.rglob(f"*{rec.seg_id}*"))
    layout = store.codec.layout(header)
    block = 8 * GEO.summary_bytes_per_chunk_layer
    raw = bytearray(path.read_bytes())
    raw[layout.summary_offset + block + 3] ^= 0xFF  # damage layer 1's summaries only
    path.write_bytes(bytes(raw))
    fd, header = store.open_for_chunks(rec.seg_id)
    assert torch.equal(store.codec.read_summaries(fd, rec.seg_id, [0, 2], header), part)  # layer 1 not read
    with pytest.raises(CorruptSegment, match="layer 1"):
        store.codec.read_summaries(fd, rec.seg_id, [1], header)
    # an older file (no per-layer checksums): the whole block is read, so layer 1's damage shows
    hlen = struct.unpack("<II", raw[8:PREAMBLE_BYTES])[0]
    old = json.loads(bytes(raw[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen]))
    del old["summary_layer_crc32"]
    with pytest.raises(CorruptSegment, match="summary checksum"):
        store.codec.read_summaries(fd, rec.seg_id, [0, 2], old | {"kv_offset": header["kv_offset"]})
    os.close(fd)


def test_two_sources_map_to_their_history_chunks(tmp_path):
    """A history of two stored nodes (one on disk from its second chunk, one in the host tier)."""
    store, rec, kv_disk = stored_segment(tmp_path, seed=3, chunks=6)
    kv_host = kv_of(4, 5)
    kv = torch.cat([kv_disk[:, :, C:], kv_host], dim=2)  # history = disk chunks 1..5, then host 0..4
    sources = [disk_source(store, rec, lo=1, hi=6, first=0), Source("h", 0, 5, 5, host_kv=kv_host)]
    job, pk, pv = restore(sources, kv, budget=1.0, disk=store)
    run_prefill(job)
    for layer in range(L):
        assert len(check_layer(job, pk, pv, kv, layer)) == 10 * C
    job.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("paged", [False, True], ids=["slots", "pages"])
def test_a_damaged_extent_never_reaches_a_plan(tmp_path, damage, paged):
    store, rec, kv = stored_segment(tmp_path, seed=5)
    path = store.path(rec.seg_id)
    src = disk_source(store, rec)
    layout = store.codec.layout(src.header)
    bad_layer, bad_chunk = 2, 11  # the last chunk: always kept (nearest the new turn)
    off = layout.extent_offset(bad_layer, bad_chunk)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(off + 3)
            b = f.read(1)
            f.seek(off + 3)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        os.truncate(path, off + 10)
    job, pk, pv = restore([src], kv, budget=1.0, period=2, disk=store, paged=paged)
    run_prefill(job)
    assert job.stats.bad_extents >= 1
    pos = job.kept_positions(bad_layer)
    assert not ((pos >= bad_chunk * C) & (pos < (bad_chunk + 1) * C)).any()  # left out, not read
    check_layer(job, pk, pv, kv, bad_layer)  # the rest is intact
    if damage == "flip":  # other layers lost nothing
        assert len(job.kept_positions(0)) == 12 * C
    job.close()


def test_a_missing_segment_is_refused_at_admission(tmp_path):
    store, rec, _ = stored_segment(tmp_path, seed=6)
    os.unlink(store.path(rec.seg_id))
    with pytest.raises(CorruptSegment):
        store.open_for_chunks(rec.seg_id)


def test_gate_waits_for_the_rest_of_the_gate():
    """With gate 2, layer 0's compute waits until layers 0 and 1 are both read."""
    kv = kv_of(7, 8)
    job, _, _ = restore([Source("s", 0, 8, 0, host_kv=kv)], kv, budget=1.0, period=4, gate=2)
    q = torch.randn(5, 2 * H, D)
    job.select(0, q, 0.3)
    job.wait(0)
    assert job.loaded[0].all() and job.loaded[1].all()
    job.close()


def test_prefix_flags_validate():
    from sgl_loopkv.cache.prefix_config import PrefixConfig
    from sgl_loopkv.config import LoopKVConfig

    assert not PrefixConfig().enabled  # budget 1.0 and no streaming: the load path as before
    assert PrefixConfig(budget=0.1).enabled and PrefixConfig(stream=True).enabled
    for bad in ({"budget": 0.0}, {"budget": 1.5}, {"period": 0}, {"gate": 0}, {"local": 0}, {"min_tokens": -1},
                {"prefetch": -0.1}, {"prefetch": 1.5}, {"selection": "tokens"}):  # fmt: skip
        with pytest.raises(ValueError):
            PrefixConfig(**bad)
    cfg = LoopKVConfig.from_flat(prefix_budget=0.25, prefix_period=4)
    assert cfg.prefix.budget == 0.25 and cfg.prefix.period == 4


def test_the_page_cache_never_grows_with_the_history_and_reselection_reuses_places():
    """Whatever the history's length, the device holds budget x chunks; a period whose selection
    differs from the one read ahead for it puts its new chunks in the places of those it dropped,
    and what every layer attends to is still exactly its chunks' stored KV."""
    for m in (8, 40, 120):
        kv = kv_of(10 + m, m)
        job, pk, pv = restore([Source("s", 0, m, 0, host_kv=kv)], kv, budget=0.25, period=2)
        assert job.cache_tokens == keep_count(m, 0.25) * C
        for q_seed in (1, 2, 3):  # a second and third extend re-select every period (chunked prefill)
            run_prefill(job, q_seed)
            for layer in range(L):
                check_layer(job, pk, pv, kv, layer)
                places = job.where[job.period_of(layer)]
                assert int((places >= 0).sum()) == job.keep and len(set(places[places >= 0].tolist())) == job.keep
        st = job.account()
        assert st.wasted_prefetch_bytes <= st.prefetched_bytes
        job.close()


def test_decode_recall_overlapped_equals_serial_and_stays_in_the_cache(tmp_path):
    """FreeKV on a pruned history: chunks chosen with a drifting decode query are recalled from disk
    into the page cache; recalling behind the next periods' compute (overlapped) leaves exactly what
    recalling at once and waiting (serial) leaves, every layer attends to its chunks' stored KV, and
    the device cache never grows."""
    store, rec, kv = stored_segment(tmp_path, seed=11, chunks=24)
    jobs = []
    for serial in (False, True):
        job, pk, pv = restore([disk_source(store, rec)], kv, budget=0.25, period=2, disk=store)
        run_prefill(job)
        decode_steps(job, 4, serial)
        job._flush_recalls(skip=None)  # the last step's decisions (the next step would make them)
        for layer in range(L):
            job.wait(layer)
            check_layer(job, pk, pv, kv, layer)
        assert job.stats.recalled_bytes > 0 and job.stats.decode_selections > 0
        assert len(job.slots) == keep_count(24, 0.25) * C
        jobs.append(job)
    for layer in range(L):
        assert torch.equal(jobs[0].kept_positions(layer), jobs[1].kept_positions(layer))
    for job in jobs:
        job.close()


# --- the backend's kept-chunk plans (fake SGLang batches) ------------------------------------------
@pytest.mark.parametrize("budget,selection", [(1.0, "chunks"), (0.4, "chunks"), (0.2, "impress")])
def test_backend_attends_to_exactly_the_kept_chunks_in_prefill_and_decode(budget, selection, impress_registered):
    """A batch of two sequences, the first with a pruned history of 20 chunks (its row points the
    history at the padding slot, filled with garbage here), the second dense. The pruned one's
    output equals dense attention over its kept chunks' stored KV and its own tokens (budget 1.0: the
    full history, i.e. the full load); the other's is untouched."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_loopkv.attention import dense_attention
    from sgl_loopkv.attention.backend import LoopKVAttnBackend
    from tests.fakes import FakeKVPool, fake_batch, fake_layer, fake_runner

    hq, layer = 2 * H, fake_layer(0, 2 * H, D, 0.3)
    pool = FakeKVPool.random(0, L, 4096, H, D)
    hist = kv_of(30, 20)  # the stored history (all layers)
    req_to_token = torch.zeros(2, 1024, dtype=torch.int32)  # row 0: history -> padding slot 0
    req_to_token[0, 320:400] = torch.arange(2000, 2080)
    req_to_token[1, :200] = torch.arange(2500, 2700)
    pool.k[0][0] = float("nan")  # whoever reads the padding slot poisons its output
    job = PrunedRestore(
        PrunedHistory("a", [Source("s", 0, 20, 0, host_kv=hist)], 20, 0, key_summaries(hist[:, 0], C)[::3]),
        KVBuffers(pool.k, pool.v), ChunkReader(), PrunedParams(C, budget, period=3, gate=2, local=2, selection=selection),
    )  # fmt: skip
    job.attach(torch.arange(3000, 3000 + job.cache_tokens))
    ctx = SimpleNamespace(cache=SimpleNamespace(pruned={"a": job}, pruned_job={"a": job}.get))
    be = LoopKVAttnBackend(fake_runner(req_to_token, pool), context=ctx)

    def expect(q, seq_len, n_new, out):
        pos = job.kept_positions(0)
        own = req_to_token[0, 320:seq_len].long()
        k = torch.cat([hist[0, 0, pos], pool.k[0][own]])
        v = torch.cat([hist[0, 1, pos], pool.v[0][own]])
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, dense_attention(q, k, v, 0.3), rtol=0, atol=1e-6)
        return pos

    fb = fake_batch(ForwardMode.EXTEND, [0, 1], [384, 200], [64, 200], torch.zeros(264, dtype=torch.int64))
    fb.rids = ["a", "b"]
    be.init_forward_metadata(fb)
    q = torch.randn(264, hq, D, generator=torch.Generator().manual_seed(3))
    out = be.forward_extend(q.view(264, -1), None, None, layer, fb, save_kv_cache=False).view(264, hq, D)
    pos = expect(q[:64], 384, 64, out[:64])
    if selection == "impress":  # the chosen tokens (budget, first and 2 nearest chunks forced), not whole chunks
        assert len(pos) == max(math.ceil(budget * 20 * C), 3 * C) and torch.equal(
            pos, job.selection.kept_tokens[0].nonzero()[:, 0]
        )
    else:
        assert len(pos) == (20 * C if budget == 1.0 else keep_count(20, budget) * C)
    other = req_to_token[1, :200].long()
    assert torch.equal(out[64:], dense_attention(q[64:], pool.k[0][other], pool.v[0][other], 0.3))

    fb = fake_batch(ForwardMode.DECODE, [0, 1], [385, 201], [1, 1], torch.zeros(2, dtype=torch.int64))
    fb.rids = ["a", "b"]
    be.init_forward_metadata(fb)
    q = torch.randn(2, hq, D, generator=torch.Generator().manual_seed(4))
    out = be.forward_decode(q.view(2, -1), None, None, layer, fb, save_kv_cache=False).view(2, hq, D)
    expect(q[:1], 385, 1, out[:1])
    job.close()
