"""Every background thread of one tiered cache, with one lifecycle (SGLang's HiRadixCache and
HiCacheController split: the tree and the store do the bookkeeping, the I/O threads live here).

Each worker's logic stays in its own module; the controller makes it, starts it and stops it::

    worker                  module            threads                          started
    disk writers, TTL sweep disk_writer.py    loopkv-disk-writer(-shared),     start()
                                              loopkv-disk-ttl
    layer loader (GPU)      loader.py         loopkv-loader                    start()
    read-ahead              prefetch.py       loopkv-disk-prefetch_0 (nice 10) its first read
    chunk reader            chunk_reader.py   loopkv-chunk-reader              its first restore
    pread pool              segment_reads.py  loopkv-pread_*                   its first parallel read

Completions reach the scheduler thread through what its hooks drain: the segments the writer
threads evicted or expired (:meth:`IOController.evicted`, drained by ``TieredKVStore.sync`` before
every lookup and store), the reads ahead (``TieredKVStore.read_ahead_done`` / ``fetch``), the
chunk-pruned restores' masks (:mod:`sgl_loopkv.cache.chunk_loads`).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sgl_loopkv.cache.chunk_reader import ChunkReader
from sgl_loopkv.cache.disk_writer import DiskWriters
from sgl_loopkv.cache.loader import LayerwiseLoader
from sgl_loopkv.cache.prefetch import DiskPrefetch
from sgl_loopkv.cache.segment_reads import PreadPool

if TYPE_CHECKING:
    from sgl_loopkv.cache.store import TieredKVStore


class IOController:
    """The owner of a cache's background threads. Contract:

    - ``make_*`` creates a worker and keeps it; one made after :meth:`start` starts at once, and
      none is made after :meth:`close` (RuntimeError). Workers started on first use stay so.
    - :meth:`start` starts the workers made so far (idempotent) and registers the one exit hook:
      at the process's normal exit :meth:`close` runs (queued disk writes reach the disk).
    - :meth:`close` stops every thread, joined, in an order where no worker outlives one it uses:
      the chunk reader and the read-ahead, the loader, the writers (their queued writes finish
      first), then the pread pools. Idempotent; a second call does nothing.

    All calls come from the scheduler thread (or the exit hook)."""

    def __init__(self):
        self.writers: DiskWriters | None = None
        self.prefetch: DiskPrefetch | None = None
        self.loader: LayerwiseLoader | None = None
        self.chunk_reader: ChunkReader | None = None
        self.preads: list[PreadPool] = []  # one per disk codec
        self.started = self.closed = False

    def make_writers(self, store: TieredKVStore, ttl_s: float | None) -> DiskWriters:
        self.writers = self._made(DiskWriters(store, ttl_s), startable=True)
        return self.writers

    def make_prefetch(self) -> DiskPrefetch:
        self.prefetch = self._made(DiskPrefetch())
        return self.prefetch

    def make_loader(self, k_buffers, v_buffers, **kwargs) -> LayerwiseLoader:
        """A :class:`LayerwiseLoader` (its arguments); a synchronous one has no thread."""
        self.loader = self._made(LayerwiseLoader(k_buffers, v_buffers, started=False, **kwargs), startable=True)
        return self.loader

    def make_chunk_reader(self) -> ChunkReader:
        self.chunk_reader = self._made(ChunkReader())
        return self.chunk_reader

    def make_preads(self) -> PreadPool:
        self.preads.append(self._made(PreadPool()))
        return self.preads[-1]

    def _made(self, worker, startable: bool = False):
        """``startable``: its threads start with :meth:`start`, not on first use."""
        if self.closed:
            raise RuntimeError("loopkv: the I/O controller is closed")
        if self.started and startable:
            worker.start()
        return worker

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        for worker in (self.writers, self.loader):
            if worker is not None:
                worker.start()
        # A weak reference: a cache dropped earlier is not kept alive by the hook.
        atexit.register(_close_at_exit, weakref.ref(self))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for worker in (self.chunk_reader, self.prefetch, self.loader, self.writers, *self.preads):
            if worker is not None:
                worker.close()

    def evicted(self) -> Iterator[str]:
        """Disk segments the writer threads evicted or expired since the last call, oldest first
        (the scheduler thread drains them: ``TieredKVStore.sync``)."""
        queue = self.writers.evicted if self.writers is not None else ()
        while queue:
            yield queue.popleft()


def _close_at_exit(ref: weakref.ref) -> None:
    io = ref()
    if io is not None:
        io.close()
