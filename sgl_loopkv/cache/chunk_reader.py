"""Where a chunk-pruned restore's chunks come from (:class:`Source`) and the one thread that reads
them (:class:`ChunkReader`), in the order the restores queued them."""

from __future__ import annotations

import functools
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sgl_loopkv.cache.chunk_cache import HostChunkCache
from sgl_loopkv.cache.copy_stream import CopyStream
from sgl_loopkv.platform import keep_torch_on_this_thread

if TYPE_CHECKING:
    from sgl_loopkv.cache.chunk_loads import ChunkLoads


@dataclass(slots=True)
class Source:
    """One stored node's part of the history: chunks ``[lo, hi)`` of segment ``seg_id`` are the
    history's chunks ``[first, first + hi - lo)``. Its KV comes from ``host_kv`` (the host tier's
    copy of exactly those chunks, ``host_kv[layer]`` -> [2, T, H, D]) or from the open segment file
    ``fd`` (``header`` verified), read a few chunks at a time; a disk source's chunks that the host
    chunk ``cache`` holds come from there, and what is read from disk is offered to it."""

    seg_id: str
    lo: int
    hi: int
    first: int
    host_kv: object | None = None
    fd: int | None = None
    header: dict | None = None
    cache: HostChunkCache | None = None

    @property
    def n_chunks(self) -> int:
        return self.hi - self.lo


@dataclass
class ChunkReader:
    """One thread that runs every restore's reads in the order they were queued (on a GPU its
    copies go to one stream per device: :class:`CopyStream`)."""

    _queue: queue.Queue = field(default_factory=queue.Queue)
    _thread: threading.Thread | None = None
    _streams: dict = field(default_factory=dict)

    def copies(self, device: torch.device) -> CopyStream:
        if device not in self._streams:
            self._streams[device] = CopyStream(device)
        return self._streams[device]

    def submit(self, job: ChunkLoads, layers: range, chunks: torch.Tensor, dst: torch.Tensor, after=None) -> None:
        self._put(functools.partial(job.load, layers, chunks, dst, after))

    def advise(self, job: ChunkLoads, jobs: list[tuple[range, torch.Tensor]]) -> None:
        self._put(functools.partial(job.advise, jobs))

    def _put(self, work) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loopkv-chunk-reader", daemon=True)
            self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        keep_torch_on_this_thread()  # no OpenMP team of its own: it would slow every later forward
        while True:
            work = self._queue.get()
            if work is None:
                return
            work()

    def close(self) -> None:
        """Finish the queued reads, then stop the thread (idempotent; a later read starts it again)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=10)
