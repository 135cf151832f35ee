"""Forget (sgl_loopkv/cache/forget.py, forget_tiers.py) on a real ``LoopKVRadixCache`` over a small
pool and a real tiered store (host arena + disk in a temp dir), no server: what is removed from every tier, what a
shared prefix keeps, durability (a byte scan of the directory, a restarted cache), the notes that
tell another worker sharing the directory, and a forget refused while a request holds the KV."""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_loopkv.cache import forget
from tests.unit.test_radix_tree import CHUNK, make_cache

SYS = list(range(1000, 1032))  # 2 chunks shared by both conversations
A = list(range(2000, 2048))  # 3 chunks of conversation A's own
B = list(range(3000, 3048))


def add_turn(cache, allocator, tokens: list[int], salt: str | None = None):
    """A finished request stored like a turn's end (tests/unit/test_radix_tree.py's, with a salt)."""
    key = RadixKey(tokens, None, cache_salt=salt)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    slots = allocator.alloc(len(tokens) - match.device_prefix_len)
    prefix = cache.path_device_indices(match.last_device_node) if match.device_prefix_len else torch.empty(0)
    cache.insert(InsertParams(key=key, value=torch.cat([prefix.to(torch.int64), slots])))
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    cache.write_through.store_path(node, [])
    cache.store.flush()
    return node


def holds(root, ids: list[int]) -> list[str]:
    """Files under ``root`` holding a run of ``ids`` (a chunk's worth): as JSON text or as int64/int32 bytes."""
    run = ids[:CHUNK]
    needles = [
        ", ".join(map(str, run)).encode(),
        struct.pack(f"<{len(run)}q", *run),
        struct.pack(f"<{len(run)}i", *run),
    ]
    return [str(f) for f in root.rglob("*") if f.is_file() and any(n in f.read_bytes() for n in needles)]


def matched(cache, tokens: list[int], rid: str = "probe") -> int:
    """Tokens of ``tokens`` the cache has (device, or loaded back from host/disk) for a new request."""
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens + [7] * CHUNK, None), req=SimpleNamespace(rid=rid)))
    cache.loader.wait_all()
    return m.device_prefix_len


def test_forget_a_history_removes_it_from_every_tier_durably(tmp_path):
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(cache, allocator, SYS + A)
    assert holds(tmp_path, A) and matched(cache, SYS + A) == len(SYS + A)
    report = forget.forget(cache, SYS + A)
    assert report.device.tokens == len(SYS + A) and report.host.segments == 1 and report.disk.segments == 1
    assert report.disk.tokens == len(SYS + A) and report.kept_shared_tokens == 0
    assert not cache.store.segments and not cache.root_node.children
    assert holds(tmp_path, A) == [] and holds(tmp_path, SYS) == []
    assert matched(cache, SYS + A) == 0
    assert forget.forget(cache, SYS + A) is None  # nothing left: the endpoint's 404
    restarted, _ = make_cache(tmp_path, host_bytes=1 << 20)
    assert matched(restarted, SYS + A) == 0


def test_forget_keeps_a_prefix_another_conversation_continues_from(tmp_path):
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(cache, allocator, SYS + A)
    add_turn(cache, allocator, SYS + B)
    report = forget.forget(cache, SYS + A, private_start=len(SYS))
    assert report.kept_shared_tokens == len(SYS) and report.rewritten_segments == 1
    assert report.device.tokens == len(A)
    assert holds(tmp_path, A) == [] and holds(tmp_path, SYS) and holds(tmp_path, B)
    assert matched(cache, SYS + A) == len(SYS) and matched(cache, SYS + B) == len(SYS + B)
    restarted, _ = make_cache(tmp_path, host_bytes=1 << 20)  # B resumes from disk alone, A only its shared prefix
    assert matched(restarted, SYS + B) == len(SYS + B)
    assert matched(restarted, SYS + A, rid="a") == len(SYS)


def test_forget_a_turn_removes_the_conversation_that_continues_it(tmp_path):
    """The messages of an earlier turn: its later turns (stored below it) are the same conversation."""
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(cache, allocator, SYS + A)
    add_turn(cache, allocator, SYS + A + B)
    report = forget.forget(cache, SYS + A, private_start=len(SYS))
    assert report.kept_shared_tokens == 0 and holds(tmp_path, B) == [] and holds(tmp_path, A) == []
    assert not cache.root_node.children


def test_forget_by_salt_removes_only_that_tenant(tmp_path):
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(cache, allocator, SYS + A, salt="tenant-a")
    add_turn(cache, allocator, SYS + B, salt="tenant-b")
    report = forget.forget(cache, salt="tenant-a")
    assert report.disk.segments == 1 and report.kept_shared_tokens == 0
    assert holds(tmp_path, A) == [] and holds(tmp_path, B)
    assert forget.forget(cache, salt="tenant-a") is None


def test_a_running_request_blocks_the_forget_and_nothing_changes(tmp_path):
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    node = add_turn(cache, allocator, SYS + A)
    cache.inc_lock_ref(node)
    with pytest.raises(forget.Busy):
        forget.forget(cache, SYS + A)
    assert holds(tmp_path, A) and matched(cache, SYS + A) == len(SYS + A)
    cache.dec_lock_ref(node)
    assert forget.forget(cache, SYS + A) is not None


def test_another_worker_on_the_directory_drops_its_copies_at_its_next_match(tmp_path):
    one, alloc_one = make_cache(tmp_path, host_bytes=1 << 20)
    two, _ = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(one, alloc_one, SYS + A)
    assert matched(two, SYS + A) == len(SYS + A)  # found on the shared disk, now in two's tree and arena
    assert two.store.segments
    notes = two.forget_notes.dir  # made at two's first match
    seen = notes.stat().st_mtime_ns
    forget.forget(one, SYS + A)
    os.utime(notes, ns=(seen, seen))  # the note landed within the mtime tick two already saw
    assert matched(two, SYS + A, rid="again") == 0
    assert not two.store.segments


def test_bad_input_is_a_value_error(tmp_path):
    cache, _ = make_cache(tmp_path, host_bytes=1 << 20)
    with pytest.raises(ValueError):
        forget.forget(cache, [1, 2, 3])  # less than a chunk: never stored
    with pytest.raises(ValueError):
        forget.forget(cache)
