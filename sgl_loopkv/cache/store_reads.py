"""The way out of the tiers (:class:`TierReads`, one per :class:`~sgl_loopkv.cache.store.TieredKVStore`):
a segment's KV from the host arena or from disk (verified, then promoted to the arena), the sources
a chunk-pruned restore reads, and whole-segment reads ahead on the read-ahead thread. A file found
gone or damaged is counted and its segment forgotten, here, whichever read found it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

import torch

from sgl_loopkv.cache.layout import key_summaries
from sgl_loopkv.cache.packed import PackedKV, kv_nbytes, slice_tokens, stored_keys
from sgl_loopkv.cache.prefetch import PrefetchedRead
from sgl_loopkv.cache.retention import tenant_of
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentGone
from sgl_loopkv.cache.tier_types import ChunkSource, StoredSegment

if TYPE_CHECKING:
    from sgl_loopkv.cache.store import TieredKVStore


class TierReads:
    """Called from the scheduler thread; only :meth:`_read` also runs on the read-ahead thread."""

    def __init__(self, store: TieredKVStore):
        self.store = store

    def read_ahead(self, seg_id: str) -> bool:
        """Start reading ``seg_id`` whole on the read-ahead thread if only the disk holds it (a later
        :meth:`fetch` takes that read); whether a read of it is still in flight."""
        store = self.store
        seg = store.segments.get(seg_id)
        if store.prefetch is None or seg is None or seg.in_host or not seg.on_disk:
            return False
        store.prefetch.start(seg_id, lambda: self._read(seg_id, 0, seg.record.n_chunks))
        return store.prefetch.pending(seg_id)

    def _read(self, seg_id: str, chunk_lo: int, chunk_hi: int, first: list[int] | None = None) -> PrefetchedRead:
        """The disk read only (verified), timed: inline in :meth:`fetch` or on the read-ahead thread
        (the caller's thread does the rest). ``bytes_read`` is the codec's count over the read: a
        chunk-pruned restore's reader reading at the same moment would be counted here too (a
        metric, not a decision, depends on it)."""
        disk, stats = self.store.disk, self.store.stats
        t0, before = time.perf_counter(), disk.bytes_read
        try:
            kv = disk.read(seg_id, chunk_lo, chunk_hi, first)
        finally:
            stats.disk_read_wall_seconds += time.perf_counter() - t0  # any thread: a metric only
        return PrefetchedRead(kv, disk.bytes_read - before, time.perf_counter() - t0)

    def fetch(
        self,
        seg_id: str,
        chunk_lo: int,
        chunk_hi: int,
        skip_chunks: list[int] | None = None,
        keep: Collection[str] = (),
    ) -> tuple[torch.Tensor, str]:
        """KV [L, 2, T, H, D] of chunks [chunk_lo, chunk_hi) and the tier it came from. A disk
        read is verified and promoted to the host arena, making room by evicting any segment but
        this one and ``keep`` (the rest of the history being restored: dropping one would cut the
        tree under the caller). ``skip_chunks[l]``: leading chunks of the range that layer l does
        not need (recomputed); a disk read then skips them and is not promoted (it is incomplete).
        Raises CorruptSegment (and forgets the segment) if the only copy is bad."""
        store = self.store
        seg = store.segments.get(seg_id)
        g = store.geometry
        c = g.chunk_tokens
        if seg is None:
            raise CorruptSegment(f"segment {seg_id} is gone")
        if seg.in_host:
            return slice_tokens(seg.host_kv, chunk_lo * c, chunk_hi * c), "host"
        if not seg.on_disk:
            raise CorruptSegment(f"segment {seg_id} has no copy")
        t0 = time.perf_counter()
        with self._disk_read(seg):  # no lock: a file evicted meanwhile by any worker is either read whole or found gone
            read = store.prefetch.take(seg_id) if store.prefetch is not None else None  # raises what its read did
            partial = read is None and skip_chunks is not None and any(skip_chunks)  # read ahead: whole
            if read is None:
                first = [chunk_lo + k for k in skip_chunks] if partial else None
                read = self._read(seg_id, *((chunk_lo, chunk_hi) if partial else (0, seg.record.n_chunks)), first)
            kv = read.kv
            store.stats.disk_bytes_read += read.bytes_read
        store.stats.load_seconds += time.perf_counter() - t0
        store.last_disk_read = (read.bytes_read, read.seconds)
        if partial:
            t = chunk_hi - chunk_lo
            store.stats.disk_bytes_used += sum(t - k for k in skip_chunks) * c * g.token_bytes_per_layer
            return kv, "disk"
        store.stats.disk_bytes_used += kv_nbytes(kv)
        nbytes = kv_nbytes(kv) + g.num_layers * seg.record.n_chunks * g.summary_bytes_per_chunk_layer
        if store.room.reserve_host(
            nbytes, keep={seg_id, *keep}, tenant=tenant_of(seg.record.cache_salt)
        ):  # promote (the summaries only once it fits)
            if isinstance(kv, PackedKV):  # a shared layer's keys are not its own: read the stored summaries
                summaries = store.disk.read_summaries(seg_id)
            else:  # the verified keys give the summaries back without another read
                summaries = key_summaries(stored_keys(kv), c).to(g.summary_dtype)
            seg.host_kv, seg.host_summaries = kv, summaries
            store.chunk_cache.drop(seg_id)  # the whole copy is in the arena now
        return slice_tokens(kv, chunk_lo * c, chunk_hi * c), "disk"

    @contextlib.contextmanager
    def _disk_read(self, seg: StoredSegment) -> Iterator[None]:
        """Around a read of ``seg``'s file: a file gone (evicted by any worker) or damaged is counted
        and the segment forgotten (a damaged file deleted); the tree recomputes that history."""
        store = self.store
        try:
            yield
        except SegmentGone:
            store.stats.gone_segments += 1
            seg.on_disk = False
            store.lose(seg.record.seg_id)
            raise
        except CorruptSegment:
            store.stats.corrupt_segments += 1
            store.lose(seg.record.seg_id)
            raise

    def chunk_source(
        self,
        seg_id: str,
        chunk_lo: int,
        chunk_hi: int,
        layers: list[int],
        keep: Collection[str] = (),
        cache_summaries: bool = False,
    ) -> ChunkSource:
        """What a chunk-pruned restore reads chunks ``[chunk_lo, chunk_hi)`` from, without reading any KV
        yet: a :class:`ChunkSource`, its key summaries those of ``layers`` only (the layers the restore
        scores at: a disk admission reads just those). A disk segment whose rows are
        packed (layer sharing) is fetched whole (:meth:`fetch`) and served as host KV. Raises
        CorruptSegment (and forgets the segment) like :meth:`fetch`; the caller closes the file.
        ``cache_summaries``: a disk admission's summaries come from, and go to, the host chunk cache."""
        store = self.store
        disk, chunk_cache = store.disk, store.chunk_cache
        seg = store.segments.get(seg_id)
        if seg is None:
            raise CorruptSegment(f"segment {seg_id} is gone")
        if not seg.in_host and seg.on_disk:
            before = disk.bytes_read
            with self._disk_read(seg):
                fd, header = disk.open_for_chunks(seg_id)
            if "side" not in header:
                summaries = chunk_cache.summaries_of(seg_id, layers) if cache_summaries else None
                try:
                    if summaries is None:
                        with self._disk_read(seg):
                            summaries = disk.codec.read_summaries(fd, seg_id, layers, header)
                        if cache_summaries:
                            chunk_cache.keep_summaries(seg_id, layers, summaries)
                except BaseException:
                    os.close(fd)
                    raise
                finally:  # admission reads (header, the scored layers' summaries) are reads too
                    store.stats.disk_bytes_read += disk.bytes_read - before
                return ChunkSource(None, fd, header, summaries[:, chunk_lo:chunk_hi].float(), "disk")
            os.close(fd)
        kv, tier = self.fetch(seg_id, chunk_lo, chunk_hi, keep=keep)
        summaries = seg.host_summaries if seg.host_summaries is not None else disk.read_summaries(seg_id)
        return ChunkSource(kv, None, None, summaries[layers, chunk_lo:chunk_hi].float(), tier)
