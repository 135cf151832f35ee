"""The host chunk cache (ContiguousKV's attention-guided chunk cache): what chunk-pruned restores
read from disk stays in the arena's free room, ranked per chunk by the value policy; segments take
the room back first; a restore that finds chunks there reads only the rest, bit-identically."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_loopkv.cache.chunk_cache import HostChunkCache
from sgl_loopkv.cache.segment_record import SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES, AttentionValuePolicy
from tests.restores import C, L, check_layer, disk_source, restore, run_prefill, stored_segment
from tests.unit.test_cache_store import GEO as STORE_GEO
from tests.unit.test_cache_store import segment

H, D = 2, 8
UNIT = 2 * C * H * D * 4  # one chunk of one layer, K and V, float32


def rows_of(seed: int, n: int, layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n * C, H, D, generator=g) for _ in range(layers)]


def fixed_values(table: dict[str, list[float]]):
    return lambda seg_id, chunks: torch.tensor(table[seg_id])[chunks]


def test_taken_rows_are_the_offered_ones_and_only_chunks_cached_at_every_layer():
    cache = HostChunkCache(lambda: 1 << 30, fixed_values({"a": [1.0] * 10}))
    rows = rows_of(0, 3, 2)
    assert cache.offer("a", range(2, 4), [1, 4, 7], rows) == 3 * 2 * UNIT == cache.stats.bytes
    hit, got = cache.take("a", range(2, 4), [0, 1, 7, 9])
    assert hit == [1, 7]
    for r, g in zip(rows, got):  # chunks 1 and 7 were the offer's first and third
        assert torch.equal(g, torch.cat([r[:, :C], r[:, 2 * C :]], dim=1))
    assert cache.take("a", range(2, 5), [1, 4]) == ([], [])  # layer 4 never offered: not a hit
    assert cache.take("b", range(2, 4), [1]) == ([], [])
    rows[0].zero_()  # the cache holds copies
    assert torch.equal(cache.take("a", range(2, 3), [1])[1][0], rows_of(0, 3, 2)[0][:, :C])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 7)), min_size=1, max_size=30))
def test_the_cache_never_holds_more_than_its_room_and_keeps_the_most_valuable(room_units, offers):
    values = {s: torch.rand(8, generator=torch.Generator().manual_seed(ord(s))).tolist() for s in "abc"}
    cache = HostChunkCache(lambda: room_units * UNIT, fixed_values(values))
    for seg, j in offers:
        cache.offer(seg, range(0, 1), [j], rows_of(j, 1, 1))
        assert cache.stats.bytes <= room_units * UNIT
    held = {(s, j) for s in "abc" for j in cache.cached_chunks(s)}
    offered = set(offers)
    assert held <= offered
    assert len(held) == min(room_units, len(offered))  # full, or everything offered is there
    if held and offered - held:  # nothing left out is worth more than what stayed
        assert max(values[s][j] for s, j in offered - held) <= min(values[s][j] for s, j in held)


def test_a_worthier_chunk_evicts_the_least_valuable_and_an_unworthy_one_is_refused():
    values = {"a": [0.1, 5.0, 1.0, 3.0]}
    cache = HostChunkCache(lambda: 2 * UNIT, fixed_values(values))
    cache.offer("a", range(1), [0, 2], rows_of(1, 2, 1))
    cache.offer("a", range(1), [3], rows_of(2, 1, 1))  # 3.0 evicts chunk 0 (0.1)
    assert cache.cached_chunks("a") == {2, 3}
    values["a"][0] = 0.5
    cache.offer("a", range(1), [0], rows_of(3, 1, 1))  # 0.5 < every cached chunk: refused
    assert cache.cached_chunks("a") == {2, 3} and cache.stats.refused_bytes == UNIT
    cache.shrink(UNIT)  # a segment needs room: the least valuable goes
    assert cache.cached_chunks("a") == {3} and cache.stats.bytes == UNIT
    cache.drop("a")
    assert cache.stats.bytes == 0 and cache.take("a", range(1), [3]) == ([], [])


def test_attention_value_ranks_chunks_by_importance_times_accesses():
    p = AttentionValuePolicy()
    p.on_access("s", 4, torch.tensor([0.5, 2.0, 1.0, 0.5]))
    p.on_access("s", 4, torch.tensor([0.5, 2.0, 0.5, 1.0]))
    v = p.chunk_values("s", torch.tensor([0, 1, 2, 3]))
    assert int(v.argmax()) == 1 and int(v.argmin()) == 0
    assert torch.equal(p.chunk_values("unknown", torch.tensor([0, 1])), torch.zeros(2))


def test_segments_take_the_arena_back_from_the_chunk_cache_and_the_quota_holds(tmp_path):
    one = STORE_GEO.segment_host_bytes(4)
    store = TieredKVStore(STORE_GEO, VALUE_POLICIES.create("attention"), 3 * one, tmp_path, 1 << 30)
    unit = 2 * STORE_GEO.chunk_tokens * STORE_GEO.num_kv_heads * STORE_GEO.head_dim * 4
    rec, kv, summ = segment(4, 1)
    store.put(rec, kv, summ)
    store.flush()
    store.register(SegmentRecord("d", None, 0, 8, 0))  # a disk-only segment, say, that a restore read from
    offered = store.chunk_cache.offer("d", range(3), list(range(8)), [torch.randn(2, 8 * 16, 2, 8) for _ in range(3)])
    assert offered == 8 * 3 * unit and store.stats.host_bytes + store.chunk_cache.stats.bytes <= store.host_quota
    for i in range(2, 4):  # two more segments: the arena's room goes back to them, chunks first
        rec, kv, summ = segment(4, i)
        assert store.put(rec, kv, summ)
        assert store.stats.host_bytes + store.chunk_cache.stats.bytes <= store.host_quota
    assert len([s for s in store.segments.values() if s.in_host]) == 3  # no segment left the arena for chunks
    assert store.chunk_cache.stats.bytes < offered
    store.flush()
    store.drop(rec.seg_id)  # room again
    chunk = [torch.randn(2, 16, 2, 8)]
    assert store.chunk_cache.offer("d", range(1), [0], chunk) == unit
    store.drop("d")  # a segment that leaves the tiers takes its cached chunks along
    assert store.chunk_cache.cached_chunks("d") == set() and store.chunk_cache.stats.bytes == 0
    assert store.chunk_cache.offer("d", range(1), [0], chunk) == 0  # a late offer of a lost segment
    assert store.chunk_cache.offer("s2", range(1), [0], chunk) == 0  # whole in the arena: nothing to add


@pytest.mark.parametrize("paged", [False, True], ids=["slots", "pages"])  # pages: read natively into the pool
def test_a_second_pruned_restore_takes_cached_chunks_and_attends_to_the_same_bytes(tmp_path, paged):
    store, rec, kv = stored_segment(tmp_path, seed=9, chunks=24, group=2)
    values = AttentionValuePolicy()
    values.on_access(rec.seg_id, rec.n_chunks)
    cache = HostChunkCache(lambda: 1 << 30, values.chunk_values)
    stats = []
    for _ in range(2):
        src = disk_source(store, rec)
        src.cache = cache
        job, pk, pv = restore([src], kv, budget=0.25, period=3, gate=1, disk=store, prefetch=0.0, paged=paged)
        run_prefill(job, q_seed=4)  # the same turn: the same selections
        for layer in range(L):
            check_layer(job, pk, pv, kv, layer)  # bit-identical, wherever each chunk came from
        stats.append(job.account())
        job.close()
        job.offer_reads()  # the server does this once the turn's output is out
    first, second = stats
    for seg in cache.segments.values():  # kept per chunk as [2, c, H, D] copies, not views of the read buffer
        assert all(
            r.shape == (2, C, *kv.shape[-2:]) and r.is_contiguous() for d in seg.layers.values() for r in d.values()
        )
    assert first.cached_bytes == 0 and first.disk_bytes_read == first.bytes_loaded
    assert second.cached_bytes == second.bytes_loaded and second.disk_bytes_read == 0
    assert cache.stats.bytes == first.bytes_loaded


def test_a_warm_admission_takes_the_key_summaries_from_the_cache(tmp_path):
    rec, kv, summ = segment(4, 7)
    one = STORE_GEO.segment_host_bytes(4)
    store = TieredKVStore(STORE_GEO, VALUE_POLICIES.create("attention"), one - 1, tmp_path, 1 << 30)
    assert store.put(rec, kv, summ) and store.tier_of(rec.seg_id) == "disk"  # too big for the arena
    read, got = [], []
    for _ in range(2):
        before = store.stats.disk_bytes_read
        _, fd, _, s, tier = store.chunk_source(rec.seg_id, 1, 4, [0, 2], cache_summaries=True)
        os.close(fd)
        read.append(store.stats.disk_bytes_read - before)
        got.append(s)
    assert tier == "disk" and torch.equal(got[0], got[1])
    assert torch.equal(got[0], summ[[0, 2], 1:4].to(STORE_GEO.summary_dtype).float())
    summary_bytes = 2 * 4 * STORE_GEO.summary_bytes_per_chunk_layer
    assert read[0] - read[1] == summary_bytes  # the second admission read the header only
    store.drop(rec.seg_id)
    assert store.chunk_cache.stats.bytes == 0
