"""The tiers' background disk work: two writer threads and the disk TTL sweep, with one lifecycle
(started and stopped by the store's :class:`~sgl_loopkv.cache.io_controller.IOController`, which
also closes them at the process's normal exit).

Two writers: one at background priority (nobody waits for its writes: the forward should not lose a
core to them) and one at normal priority for writes another worker sharing the directory may be
waiting for (its lookup found the announcement; it recomputes if the write takes over
``PENDING_WAIT_S``, which a niced writer did on 2 busy cores). The threads touch only the disk
store, a segment's ``pending_disk``/``on_disk`` flags, the counters and :attr:`DiskWriters.evicted`,
which the store's ``sync`` drains on the scheduler thread.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections import deque
from shutil import disk_usage
from typing import TYPE_CHECKING

from sgl_loopkv.cache.disk_evict import NoRoom
from sgl_loopkv.platform import keep_torch_on_this_thread, yield_cpu_to_the_forward

if TYPE_CHECKING:
    from sgl_loopkv.cache.store import TieredKVStore

logger = logging.getLogger(__name__)


class DiskWriters:
    def __init__(self, store: TieredKVStore, ttl_s: float | None = None):
        self.store, self.ttl_s = store, ttl_s
        self.evicted: deque[str] = deque()  # disk segments the threads evicted or expired, for store.sync()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._shared_queue: queue.Queue[str | None] = queue.Queue()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the writer threads and, with a TTL, expire now and start the sweep (idempotent)."""
        if self._threads:
            return
        for q, background, name in ((self._queue, True, "loopkv-disk-writer"),
                                    (self._shared_queue, False, "loopkv-disk-writer-shared")):  # fmt: skip
            self._start(name, self._write_loop, q, background)
        if self.ttl_s:  # at start-up (nothing of it is known here yet), then periodically
            store = self.store
            store.stats.disk_expired += len(store.disk.expire(self.ttl_s))
            store.stats.disk_bytes = store.disk.used_bytes
            self._start("loopkv-disk-ttl", self._expire_loop)

    def _start(self, name: str, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def queue(self, seg_id: str, shared: bool) -> None:
        """Write ``seg_id`` in the background; ``shared``: another worker may be waiting for it."""
        (self._shared_queue if shared else self._queue).put(seg_id)

    def write(self, seg_id: str) -> None:
        """Write ``seg_id``'s host copy to disk now, on the calling thread (a writer thread, or the
        store's for a segment too big for the arena); a refusal is counted and logged, never raised."""
        store, disk = self.store, self.store.disk
        seg = store.segments.get(seg_id)
        try:
            if seg is not None and seg.host_kv is not None:
                self.evicted.extend(disk.write(seg.record, seg.host_kv, seg.host_summaries))
                seg.on_disk = True
            elif seg is not None:  # its only copy went before the write: nothing will be published
                disk.unannounce(seg.record)
        except NoRoom as e:  # every other segment is being written: stays in the arena (if it is there)
            logger.info("loopkv: segment %s not stored on disk: %s", seg_id, e)
        except Exception as e:  # whatever went wrong, the writer thread lives on (flush() waits for it)
            store.stats.disk_write_errors += 1
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                store.stats.disk_full_writes += 1
                # Something else filled the filesystem: hold the tier to what it has plus what is still
                # free, so later stores replace the least valuable segments (or stay in host memory)
                # instead of failing too.
                before = disk.quota_bytes
                disk.quota_bytes = min(before, disk.used_bytes + disk_usage(disk.root).free)
                logger.warning(
                    "loopkv: disk full writing segment %s (%s): not stored on disk (kept in host memory where it "
                    "fits); disk tier quota lowered from %.3f to %.3f GB until restart",
                    seg_id,
                    e,
                    before / 1e9,
                    disk.quota_bytes / 1e9,
                )
            else:
                logger.exception(
                    "loopkv: writing segment %s to disk failed: not stored on disk (kept in host memory where it fits)",
                    seg_id,
                )
        finally:
            if seg is not None:
                seg.pending_disk = False
            store.stats.disk_bytes = disk.used_bytes

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._queue.join()
        self._shared_queue.join()

    def close(self) -> None:
        """Finish the queued writes, then stop every thread (idempotent)."""
        if not self._threads:
            return
        self.flush()
        self._closing.set()
        for q in (self._queue, self._shared_queue):
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []
        self.store.disk.presence.close()

    def _write_loop(self, q: queue.Queue, background: bool) -> None:
        keep_torch_on_this_thread()  # no OpenMP team of its own: it would slow every later forward
        if background:
            yield_cpu_to_the_forward()  # a write nobody waits for can wait; the next request's prefill should not
        while True:
            seg_id = q.get()
            if seg_id is None:
                q.task_done()
                return
            try:
                self.write(seg_id)
            finally:
                q.task_done()

    def _expire_loop(self) -> None:
        """Every min(TTL / 4, 60 s): segments unused for the TTL leave the disk; store.sync() tells the tree."""
        disk, stats = self.store.disk, self.store.stats
        while not self._closing.wait(min(self.ttl_s / 4, 60.0)):
            try:
                gone = disk.expire(self.ttl_s)
            except OSError:
                logger.exception("loopkv: expiring disk segments failed (tried again later)")
                continue
            stats.disk_expired += len(gone)
            self.evicted.extend(gone)
            stats.disk_bytes = disk.used_bytes
