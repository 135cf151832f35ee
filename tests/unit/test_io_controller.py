"""One owner of the cache's background threads (cache/io_controller.py): the store starts them, one
close stops every one of them (writers, TTL sweep, read-ahead, loader, chunk reader, pread pool),
twice is harmless, and the read-ahead thread keeps its background priority."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from sgl_loopkv.cache.io_controller import IOController
from sgl_loopkv.cache.prefetch import PrefetchedRead
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES
from sgl_loopkv.platform import BACKGROUND_NICE
from tests.unit.test_cache_store import GEO, segment


def disk_store(tmp_path, **kw) -> TieredKVStore:
    return TieredKVStore(GEO, VALUE_POLICIES.create("lru"), GEO.segment_host_bytes(4), tmp_path, 1 << 30, **kw)


def new_threads(before: set[threading.Thread]) -> dict[str, threading.Thread]:
    """This test's loopkv threads (other tests' stores may leave theirs running)."""
    return {t.name: t for t in threading.enumerate() if t not in before and t.name.startswith("loopkv")}


def read(value: int = 0):
    return lambda: PrefetchedRead(torch.full((1,), value), 1, 0.0)


class NoJob:
    def advise(self, jobs) -> None:
        pass


def start_every_worker(store: TieredKVStore) -> None:
    """Wake the workers that start on first use, and make the tree's two."""
    io = store.io
    store.prefetch.start("x", read())
    assert list(store.disk.codec.readers.map(abs, [1, -2, 3])) == [1, 2, 3]
    k = [torch.zeros(8, 2, 8) for _ in range(GEO.num_layers)]
    io.make_loader(k, [b.clone() for b in k], synchronous=False)  # started at once: the controller runs
    io.make_chunk_reader().advise(NoJob(), [])


def test_the_store_starts_its_threads_and_one_close_stops_every_one(tmp_path):
    before = set(threading.enumerate())
    store = disk_store(tmp_path, disk_ttl_s=3600)
    assert store.io.started and set(new_threads(before)) == {
        "loopkv-disk-writer",
        "loopkv-disk-writer-shared",
        "loopkv-disk-ttl",
    }
    start_every_worker(store)
    threads = new_threads(before)
    assert {"loopkv-loader", "loopkv-chunk-reader", "loopkv-disk-prefetch_0"} <= set(threads)
    assert any(name.startswith("loopkv-pread") for name in threads)
    store.close()
    assert not new_threads(before) and not any(t.is_alive() for t in threads.values())


def test_close_twice_is_harmless_and_nothing_is_made_after_it(tmp_path):
    store = disk_store(tmp_path)
    store.put(*segment(4, 1))
    store.close()
    assert store.disk.path("s1").exists()  # the queued write finished before the threads stopped
    store.close()
    store.io.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.io.make_chunk_reader()


def test_a_store_closed_by_the_controller_has_no_live_pread_threads(tmp_path):
    before = set(threading.enumerate())
    store = disk_store(tmp_path)
    store.put(*segment(4, 2))
    store.flush()
    list(store.disk.codec.readers.map(abs, range(8)))
    preads = [t for name, t in new_threads(before).items() if name.startswith("loopkv-pread")]
    assert preads and store.disk.codec.readers in store.io.preads
    store.io.close()
    assert not any(t.is_alive() for t in preads)


def test_a_controller_given_to_the_store_owns_its_threads_and_a_synchronous_loader_has_none(tmp_path):
    io = IOController()
    k = [torch.zeros(8, 2, 8)]
    before = set(threading.enumerate())
    loader = io.make_loader(k, [k[0].clone()], synchronous=True)
    store = disk_store(tmp_path, io=io, read_ahead=False)
    assert store.io is io and io.loader is loader and store.prefetch is None
    assert "loopkv-loader" not in new_threads(before)
    io.close()
    assert not new_threads(before)


def test_the_read_ahead_thread_gives_way_by_priority_only_while_others_run(tmp_path, monkeypatch):
    """The read-ahead's thread is niced (platform.yield_cpu_to_the_forward) while the scheduler has
    other requests running, and back at normal priority for a read with nothing else to run (where
    this process may raise a priority: it stays lowered where it may not)."""
    monkeypatch.delenv("LOOPKV_READ_AHEAD_NICE", raising=False)
    monkeypatch.delenv("LOOPKV_READ_AHEAD_PACED", raising=False)
    store = disk_store(tmp_path)
    nice = []

    def read_once(name: str, busy: bool) -> int:
        store.prefetch.pacing.set_busy(busy)
        store.prefetch.start(
            name, lambda: (nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())), read()())[1]
        )
        while not store.prefetch.done(name):
            time.sleep(0.005)
        return nice[-1]

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert read_once("busy", True) == max(BACKGROUND_NICE, mine)
    idle = read_once("idle", False)
    assert idle == (mine if store.prefetch.pacing._can_raise else max(BACKGROUND_NICE, mine))
    assert read_once("busy again", True) == max(BACKGROUND_NICE, mine)
    store.close()
