"""Whole-segment disk reads on a thread, so that no request waits on the scheduler thread for one.

A returning history found on the disk tier was read and verified whole inside ``match_prefix``,
on the scheduler thread (0.1-0.5 s for 2-8K tokens from a cold disk here): every other request of
the server waited with it, decodes in flight included. Now the lookup of a request the scheduler is
about to admit only starts the reads of its disk-only segments here (:meth:`start`) and the
request sits out the scheduler's rounds (the hold-back of :mod:`sgl_loopkv.cache.awaited`) until
they are done; then ``TieredKVStore.fetch`` takes the read (:meth:`take`) instead of reading,
promotes it to the host arena and the history loads layer by layer like a host hit. Everything
but the read itself (the tree, the arena, the counters) stays on the scheduler thread.

A read that failed (a damaged or evicted file) is taken like a good one and raises in ``fetch``
as an inline read would. Finished reads nobody took (the request was aborted, the segment dropped)
are let go after ``ttl_s``, beyond ``max_done`` of them or beyond ``max_done_bytes`` in all (oldest
first), so they cannot pile up in RAM; a request whose read was let go reads inline.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from sgl_loopkv.cache.packed import kv_nbytes
from sgl_loopkv.cache.read_pacing import ReadPacing, checkpoint
from sgl_loopkv.platform import keep_torch_on_this_thread, yield_cpu_to_the_forward


@dataclass(slots=True)
class PrefetchedRead:
    kv: object  # what the read returned: [L, 2, T, H, D] or a PackedKV
    bytes_read: int
    seconds: float


class DiskPrefetch:
    """Reads run on one thread (disk reads queue behind each other anyway; its torch ops stay on
    it, off the forward's OpenMP team); the methods are called from the scheduler thread only."""

    def __init__(self, max_done: int = 8, ttl_s: float = 60.0, max_done_bytes: int = 1 << 30):
        self.max_done, self.ttl_s, self.max_done_bytes = max_done, ttl_s, max_done_bytes
        self.pacing = ReadPacing()  # the scheduler says whether other requests are running
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="loopkv-disk-prefetch",
            initializer=_reader_thread,
            initargs=(self.pacing,),
        )
        self._reads: OrderedDict[str, tuple[Future, float]] = OrderedDict()  # seg_id -> (read, started)
        self.started = 0  # reads started, for logs and tests
        self.expired = 0  # finished reads let go untaken

    def start(self, seg_id: str, read: Callable[[], PrefetchedRead]) -> None:
        """Run ``read`` (``seg_id``'s) on the thread unless a read of ``seg_id`` is in flight or done."""
        if seg_id in self._reads:
            return
        self._reads[seg_id] = (self._pool.submit(_read_paced, read), time.monotonic())
        self.started += 1
        self._expire()

    def pending(self, seg_id: str) -> bool:
        """Whether a read of ``seg_id`` is in flight (started and not done)."""
        hit = self._reads.get(seg_id)
        return hit is not None and not hit[0].done()

    def done(self, seg_id: str) -> bool:
        """Whether a finished read of ``seg_id`` waits to be taken."""
        hit = self._reads.get(seg_id)
        return hit is not None and hit[0].done()

    def take(self, seg_id: str, wait: bool = True) -> PrefetchedRead | None:
        """The read of ``seg_id`` (removed from the table), waiting for it if it is still in flight
        (one read, never two: ``wait=False`` returns None then); None if none was started. Raises
        what the read raised."""
        hit = self._reads.get(seg_id)
        if hit is None or (not wait and not hit[0].done()):
            return None
        del self._reads[seg_id]
        return hit[0].result()

    def discard(self, seg_id: str) -> None:
        """Forget ``seg_id``'s read (the segment is gone); one in flight finishes and is dropped."""
        self._reads.pop(seg_id, None)

    def close(self) -> None:
        """Stop the thread after the read in flight; reads not begun are dropped (idempotent)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()

    def _expire(self) -> None:
        now = time.monotonic()
        done = [s for s, (f, _) in self._reads.items() if f.done()]  # oldest first
        held = sum(_bytes_of(self._reads[s][0]) for s in done)
        for i, s in enumerate(done):
            if now - self._reads[s][1] > self.ttl_s or len(done) - i > self.max_done or held > self.max_done_bytes:
                held -= _bytes_of(self._reads.pop(s)[0])
                self.expired += 1


def _reader_thread(pacing: ReadPacing) -> None:
    keep_torch_on_this_thread()
    # The running requests' steps come first (the held request waits for the read anyway): at normal
    # priority its preads, page faults and checksums took a core from the forward's OpenMP team and
    # a decode beside it slowed ~3x while the read lasted (docs/decisions/2026-12-06-read-ahead-niced.md).
    niced = os.environ.get("LOOPKV_READ_AHEAD_NICE") != "0"  # 0: normal priority, for comparison (studies/disk_read)
    if os.environ.get("LOOPKV_READ_AHEAD_PACED", "1") != "0":  # 0: no naps, for comparison
        pacing.install(by_priority=niced)  # lowered only while others run
    elif niced:
        yield_cpu_to_the_forward()


def _read_paced(read: Callable[[], PrefetchedRead]) -> PrefetchedRead:
    checkpoint()  # the reader's priority as the scheduler's last round asks, before the first piece
    return read()


def _bytes_of(read: Future) -> int:
    """RAM a finished read holds (a failed one: none)."""
    return 0 if read.exception() is not None else kv_nbytes(read.result().kv)
