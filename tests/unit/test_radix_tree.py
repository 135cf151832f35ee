"""The loopkv radix cache's tree against its tiers, in process: a real ``LoopKVRadixCache`` over a
small KV pool and a real tiered store (host arena + disk in a temp dir), no server.

What these pin: a match that loads stored history back never hands out slots through a node that
a tier lost meanwhile (such a node is no longer in the tree: its slots would be freed by eviction
and still read by the request, or owned twice after the request's insert)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_loopkv.cache.disk_announce import PENDING
from sgl_loopkv.cache.node import ref_of
from sgl_loopkv.cache.radix import LoopKVRadixCache
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES

CHUNK, LAYERS, HEADS, DIM, SLOTS = 16, 2, 2, 8, 512


class PagedAllocator:
    """SGLang's paged allocator as the radix cache uses it: whole pages out, segments back."""

    device = torch.device("cpu")

    def __init__(self, kv_pool):
        self.kv_pool = kv_pool
        self.free_pages = list(range(1, SLOTS // CHUNK))  # page 0 is SGLang's padding page

    def get_kvcache(self):
        return self.kv_pool

    def available_size(self) -> int:
        return len(self.free_pages) * CHUNK

    def alloc(self, n: int):
        if n % CHUNK or n // CHUNK > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[: n // CHUNK], self.free_pages[n // CHUNK :]
        return torch.cat([torch.arange(p * CHUNK, (p + 1) * CHUNK) for p in pages])

    def free_segment(self, slots, start_pos: int = 0):
        pages = sorted({int(s) // CHUNK for s in slots})
        assert not set(pages) & set(self.free_pages), f"pages {pages} freed twice"
        self.free_pages += pages

    def free(self, slots):
        self.free_segment(slots)


class KVPool:
    size = SLOTS

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.k_buffer = [torch.randn(SLOTS, HEADS, DIM, generator=g) for _ in range(LAYERS)]
        self.v_buffer = [torch.randn(SLOTS, HEADS, DIM, generator=g) for _ in range(LAYERS)]

    def register_layer_transfer_counter(self, counter):
        self.counter = counter


def make_cache(tmp_path, host_bytes: int, prefix=None):
    pool = KVPool()
    allocator = PagedAllocator(pool)
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=CHUNK
    )

    def store_factory(geometry, on_lost):
        return TieredKVStore(
            geometry,
            VALUE_POLICIES.create("lru"),
            host_quota_bytes=host_bytes,
            disk_dir=tmp_path,
            disk_quota_bytes=1 << 30,
            on_lost=on_lost,
        )

    return LoopKVRadixCache(params, kv_pool=pool, store_factory=store_factory, prefix=prefix), allocator


def add_turn(cache, allocator, tokens: list[int]):
    """A finished request: its tokens inserted with fresh slots, then stored like a turn's end."""
    key = RadixKey(tokens, None)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    slots = allocator.alloc(len(tokens) - match.device_prefix_len)
    prefix = cache.path_device_indices(match.last_device_node) if match.device_prefix_len else torch.empty(0)
    value = torch.cat([prefix.to(torch.int64), slots])
    cache.insert(InsertParams(key=key, value=value))
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    cache.write_through.store_path(node, [])
    cache.store.flush()
    return node


def attached(cache, node) -> bool:
    while node is not cache.root_node:
        if node.parent is None or node.parent.children.get(node.key.child_key(CHUNK)) is not node:
            return False
        node = node.parent
    return True


def test_a_segment_lost_while_a_later_one_is_promoted_cuts_the_restored_history_there(tmp_path):
    """History A (host only) then B (disk only, below A). Loading B promotes it into the arena,
    whose quota makes room by dropping A, the only copy: A leaves the tree, so the match must not
    hand out A (nor B below it) as a device prefix."""
    a, b = list(range(100, 132)), list(range(200, 232))
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    node_a = add_turn(cache, allocator, a)
    node_b = add_turn(cache, allocator, a + b)
    seg_a, seg_b = cache.store.segments[node_a.lkv[0]], cache.store.segments[node_b.lkv[0]]
    assert seg_a.on_disk and seg_b.on_disk
    # A: only in the arena (its file gone); B: only on disk.
    cache.store.disk.delete(seg_a.record.seg_id)
    seg_a.on_disk = False
    if seg_b.in_host:
        cache.store.stats.host_bytes -= cache.store._host_bytes(seg_b)
        seg_b.host_kv = seg_b.host_summaries = None
    assert seg_a.in_host
    cache.store.host_quota = cache.store.stats.host_bytes + 1  # A fits; B's promotion must drop A
    cache.evict(EvictParams(num_tokens=SLOTS))
    assert node_a.evicted and node_b.evicted

    req = SimpleNamespace(rid="r")
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(a + b + [7] * 16, None), req=req))
    last = match.last_device_node
    assert attached(cache, last), "the match handed out a prefix through nodes no longer in the tree"
    assert match.device_prefix_len == len(cache.path_device_indices(last))
    # Every slot is owned once: evicting everything frees each page exactly once (the allocator asserts).
    cache.evict(EvictParams(num_tokens=SLOTS))


def test_a_failing_chunk_pruned_admission_loads_the_history_instead(tmp_path, monkeypatch, caplog):
    """Whatever goes wrong while admitting a chunk-pruned restore (here: an unexpected error from
    the store), the history is restored the tree's way and nothing leaks: no crashed scheduler, no
    pruned job, the disk sources opened so far closed."""
    from sgl_loopkv.cache.prefix_config import PrefixConfig

    hist = list(range(300, 364))
    cache, allocator = make_cache(tmp_path, host_bytes=0, prefix=PrefixConfig(budget=0.5, min_tokens=16))
    node = add_turn(cache, allocator, hist)
    cache.evict(EvictParams(num_tokens=SLOTS))
    assert node.evicted
    disk, opened = cache.store.disk, []
    open_for_chunks = disk.open_for_chunks

    def recording_open(seg_id):
        fd, header = open_for_chunks(seg_id)
        opened.append(fd)
        return fd, header

    def failing_read(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(disk, "open_for_chunks", recording_open)
    monkeypatch.setattr(type(disk.codec), "read_summaries", failing_read)
    monkeypatch.setattr(cache.restorer, "_stack", object())  # as if the loopkv backend ran (it runs pruned plans)
    req = SimpleNamespace(rid="r")
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(hist + [7] * 16, None), req=req))
    assert "chunk-pruned admission failed" in caplog.text and "r" not in cache.pruned
    assert match.device_prefix_len == len(hist)  # loaded whole instead
    assert opened  # the history was on disk: its file was opened for the restore, then closed
    for fd in opened:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_pruned_restore_is_adopted_once_its_row_is_written_and_gives_its_slots_back_at_release(tmp_path, monkeypatch):
    """A chunk-pruned restore admitted by a match holds its page cache outside the tree. Reading the
    row's prefix (prefix_device_indices) changes nothing; SGLang's maybe_hand_to_session, called once
    the row is written, makes it the running request's (a queued one would be dropped after
    UNADOPTED_S); on_release frees its page cache."""
    from sgl_loopkv.cache.prefix_config import PrefixConfig

    hist = list(range(300, 364))
    cache, allocator = make_cache(tmp_path, host_bytes=0, prefix=PrefixConfig(budget=0.5, min_tokens=16))
    add_turn(cache, allocator, hist)
    cache.evict(EvictParams(num_tokens=SLOTS))
    monkeypatch.setattr(cache.restorer, "_stack", object())  # as if the loopkv backend ran (it runs pruned plans)
    free_before = allocator.available_size()
    req = SimpleNamespace(rid="r")
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(hist + [7] * 16, None), req=req))
    job = cache.pruned_job("r")
    assert job is not None and match.device_prefix_len == len(hist) == job.tokens
    assert allocator.available_size() == free_before - job.cache_tokens
    req.last_node, req.prefix_len = match.last_device_node, match.device_prefix_len
    indices = cache.prefix_device_indices(req)
    assert indices.tolist() == [0] * len(hist)  # the padding slot: the plans read the page cache instead
    assert "r" not in cache.pruned_admission.adopted  # a read, not an adoption
    cache.maybe_hand_to_session(req)
    assert "r" in cache.pruned_admission.adopted
    cache.on_release(req, checkpointed=False)
    assert cache.pruned_job("r") is None and not cache.pruned_admission.adopted
    assert allocator.available_size() == free_before and cache.pruned_stats.cache_tokens == job.cache_tokens


def test_a_finished_turn_is_stored_at_the_flush_after_its_output_and_before_any_eviction(tmp_path):
    """A turn's store waits for SGLang's flush_pending_backups (called once the batch's outputs are
    streamed: the last token does not wait for the copy and its encoding); until then its nodes stay
    locked on the device, and an eviction stores them first instead of dropping them unstored."""
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    tokens = list(range(300, 364))
    key = RadixKey(tokens, None)
    cache.insert(InsertParams(key=key, value=allocator.alloc(len(tokens))))
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    evictable = cache.evictable_size()
    cache.queue_backup(node, [], None)
    assert ref_of(node) is None and not cache.store.segments  # nothing stored yet
    # ... but announced on the disk tier: another worker's lookup waits for it rather than recomputing
    pending = cache.store.disk.names.chunk(cache.write_through.record_of(node).chunk_hashes[0], PENDING)
    assert pending.exists()
    assert cache.evictable_size() == evictable - len(tokens) and cache.protected_size() == len(tokens)
    cache.evict(EvictParams(num_tokens=len(tokens)))  # stores first, then evicts the device copy
    assert ref_of(node) is not None and cache.store.segments
    cache.store.flush()
    assert not pending.exists()  # published
    assert cache.protected_size() == 0 and node.evicted and attached(cache, node)  # kept as a stored node

    tokens2 = list(range(400, 432))
    key2 = RadixKey(tokens2, None)
    cache.insert(InsertParams(key=key2, value=allocator.alloc(len(tokens2))))
    node2 = cache.match_prefix(MatchPrefixParams(key=key2)).last_device_node
    cache.queue_backup(node2, [], None)
    cache.flush_pending_backups()  # what SGLang calls after streaming the batch's outputs
    assert ref_of(node2) is not None and cache.protected_size() == 0 and not node2.evicted
    cache.flush_pending_backups()  # nothing left: a no-op
    cache.store.flush()
