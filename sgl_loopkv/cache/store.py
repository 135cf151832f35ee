"""The host and disk tiers behind one object: segments in, segments out, quotas held.

A segment enters through :meth:`TieredKVStore.put` (host arena, then written through to disk
in the background) and leaves the last tier only when a quota forces it; then ``on_lost(seg_id)``
tells the radix tree. The host arena is private and evicts the least valuable segment first
(:mod:`sgl_loopkv.cache.value`). The disk tier is shared with the other workers of a cluster
(:mod:`sgl_loopkv.cache.disk`): it evicts the least recently used segment of *any* worker, and a
worker learns of others' segments by finding them (:meth:`TieredKVStore.register`) and of their
evictions when a read finds a file gone (recomputed, like a corrupt one). A write the disk refuses
is counted (``disk_write_errors``) and logged, and the segment stays where it was (host arena) or is
not stored; a full disk also lowers the tier's quota to what fits. All calls come from the scheduler
thread; the disk writer is the only other thread and touches only the disk store, the ``pending``
flags, the counters and the ``evicted`` queue that :meth:`TieredKVStore.sync` drains
(:mod:`sgl_loopkv.cache.disk_writer`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

import torch

from sgl_loopkv.cache.chunk_cache import HostChunkCache
from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.disk_dir import DirectoryLock
from sgl_loopkv.cache.disk_writer import DiskWriters
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.packed import PackedKV, kv_nbytes, quantize_rows, slice_tokens, stored_keys
from sgl_loopkv.cache.prefetch import DiskPrefetch, PrefetchedRead
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.retention import Candidate, RetentionBook, tenant_label, tenant_of
from sgl_loopkv.cache.segment_record import LAYER_GROUP, CorruptSegment, SegmentGone, SegmentRecord
from sgl_loopkv.cache.tier_types import ChunkSource, StoredSegment, TierStats
from sgl_loopkv.cache.value import ValuePolicy

logger = logging.getLogger(__name__)


class TieredKVStore:
    def __init__(
        self,
        geometry: KVGeometry,
        policy: ValuePolicy,
        host_quota_bytes: int,
        disk_dir: Path | None = None,
        disk_quota_bytes: int = 0,
        on_lost: Callable[[str], None] = lambda seg_id: None,
        dir_lock: DirectoryLock | None = None,
        layer_group: int = LAYER_GROUP,
        read_ahead: bool = True,
        disk_ttl_s: float | None = None,
        retention: RetentionBook | None = None,
        disk_cipher: SegmentCipher | None = None,
    ):
        self.geometry, self.policy = geometry, policy
        self.dir_lock = dir_lock  # a shared hold while the store lives (keeps format-2 servers out)
        self.host_quota = host_quota_bytes
        self.on_lost = on_lost
        self.segments: dict[str, StoredSegment] = {}
        self.stats = TierStats()
        self.retention = retention or RetentionBook()  # pins and tenant shares (cache.retention)
        # Chunks that pruned restores read from disk, in the arena's room that segments leave free
        self.chunk_cache = HostChunkCache(
            lambda: self.host_quota - self.stats.host_bytes, policy.chunk_values, self._disk_only
        )
        self.last_disk_read = (0, 0.0)  # (bytes, seconds) of the latest disk fetch: the restorer learns from it
        self.disk = (
            DiskSegmentStore(disk_dir, disk_quota_bytes, geometry, layer_group, disk_cipher) if disk_dir else None
        )
        # Whole-segment reads ahead of admission, off the scheduler thread (--loopkv-disk-read background)
        self.prefetch = DiskPrefetch() if self.disk is not None and read_ahead else None
        # the writer threads and the TTL sweep (cache.disk_writer): started here, stopped by close()
        self.writers = DiskWriters(self, disk_ttl_s) if self.disk is not None else None
        if self.disk is not None:
            self.stats.disk_bytes = self.disk.used_bytes

    # --- in ------------------------------------------------------------------------------------
    def encode(
        self, kv: torch.Tensor, pairs: list[tuple[int, int]] = (), codec: str | None = None
    ) -> torch.Tensor | QuantKV | PackedKV:
        """The stored form of a segment's KV [L, 2, T, H, D] as the pool holds it: cast to the
        stored dtype, similar layer ``pairs`` sharing one row (``codec``), int8 rows when the
        geometry is quantized (after packing: the pair codec sees the pool's values)."""
        quantized = self.geometry.quantized
        if not quantized:
            kv = kv.to(self.geometry.dtype)
        if pairs:  # the summaries stay per layer
            kv = PackedKV.pack(kv, pairs, codec)
        if quantized:
            kv = quantize_rows(kv)
        return kv

    def put(
        self,
        record: SegmentRecord,
        kv: torch.Tensor | QuantKV | PackedKV,
        summaries: torch.Tensor | None = None,
        pairs: list[tuple[int, int]] = (),
        codec: str | None = None,
    ) -> bool:
        """Store a new segment wherever it fits: host arena now and disk in the background, or
        either alone (host-only segments are lost when the arena evicts them). False if neither.

        ``kv``: the pool's KV [L, 2, T, H, D] (encoded here, see :meth:`encode`; ``summaries``
        default to its keys' chunk summaries), or an already encoded segment with its summaries."""
        if isinstance(kv, torch.Tensor):
            if summaries is None:
                summaries = key_summaries(kv[:, 0], self.geometry.chunk_tokens)
            kv = self.encode(kv, pairs, codec)
        summaries = summaries.to(self.geometry.summary_dtype)
        nbytes = kv_nbytes(kv) + summaries.numel() * summaries.element_size()
        self.sync()
        if record.seg_id in self.segments:  # the same history, stored under the same name already
            return True
        # The disk's own eviction makes room when the write happens (it needs the shared directory's view).
        to_disk = self.disk is not None and self.disk.file_bytes(record.n_chunks, len(record.token_ids)) <= (
            self.disk.quota_bytes
        )
        tenant = tenant_of(record.cache_salt)
        if to_disk and self.retention.disk_share < 1.0:
            to_disk = self._tenant_disk_room(tenant, self.disk.file_bytes(record.n_chunks, len(record.token_ids)))
        in_host = self._reserve_host(nbytes, tenant=tenant)
        if not (in_host or to_disk):
            return False
        seg = StoredSegment(record, kv, summaries, pending_disk=to_disk)
        self.segments[record.seg_id] = seg
        self.policy.on_access(record.seg_id, record.n_chunks)
        if to_disk:
            self.disk.announce(record)  # another worker's lookup of it waits for the write, not recomputes
        if in_host:
            if to_disk:
                self.writers.queue(record.seg_id, shared=self.disk.presence.others())
        else:  # too big for the arena: write from this copy now, keep it on disk only
            self.writers.write(record.seg_id)
            self.sync()
            seg.host_kv = seg.host_summaries = None
            if not seg.on_disk:  # the write failed: no tier holds it (the tree never saw it: no on_lost)
                del self.segments[record.seg_id]
                self.policy.forget(record.seg_id)
                return False
        return True

    def flush(self) -> None:
        """Wait until every queued disk write is done."""
        if self.writers is not None:
            self.writers.flush()

    def close(self) -> None:
        if self.writers is not None:
            self.writers.close()
        if self.dir_lock is not None:
            self.dir_lock.release()

    # --- room ----------------------------------------------------------------------------------
    def _host_bytes(self, seg: StoredSegment) -> int:
        return kv_nbytes(seg.host_kv) + seg.host_summaries.numel() * seg.host_summaries.element_size()

    def _reserve_host(self, nbytes: int, keep: Collection[str] = (), tenant: str | None = None) -> bool:
        """Room for a segment of ``nbytes`` (of ``tenant``) in the arena, counted as held (the caller
        puts it there): the chunk cache gives its room first (copies of disk extents), then segments
        but ``keep`` and pinned ones go, an over-share tenant's first, least valuable first
        (:meth:`RetentionBook.victim`)."""
        if nbytes > self.host_quota:
            return False
        # the scheduler thread is the only one that adds to the cache or the arena: no lock across both
        self.chunk_cache.shrink(max(self.host_quota - self.stats.host_bytes - nbytes, 0))
        while self.stats.host_bytes + nbytes > self.host_quota:
            pick = self.retention.victim(
                self._candidates(lambda s: s.in_host and s.record.seg_id not in keep, self._host_bytes),
                self.host_quota,
                self.retention.host_share,
                tenant,
                nbytes,
            )
            if pick is None:
                return False
            victim = self.segments[pick.seg_id]
            if victim.pending_disk:
                self.flush()  # never drop the only copy while its disk write is queued
            self.stats.host_bytes -= self._host_bytes(victim)
            victim.host_kv = victim.host_summaries = None
            if not victim.on_disk:
                self._lose(victim.record.seg_id)
        self.stats.host_bytes += nbytes
        return True

    def _candidates(self, which: Callable[[StoredSegment], bool], nbytes: Callable[[StoredSegment], int]):
        return [
            Candidate(s.record.seg_id, tenant_of(s.record.cache_salt), nbytes(s), self.policy.value(s.record.seg_id))
            for s in self.segments.values()
            if which(s)
        ]

    def _disk_bytes(self, seg: StoredSegment) -> int:
        return self.disk.file_bytes(seg.record.n_chunks, len(seg.record.token_ids))

    def _tenant_disk_room(self, tenant: str, nbytes: int) -> bool:
        """With a disk share: delete ``tenant``'s least valuable disk segments (this worker's view of the
        shared tier) until ``nbytes`` more stay within its share; False when they cannot. Beyond the
        share the disk's own LRU eviction (any worker's segments) still holds the whole quota."""
        limit = self.retention.disk_share * self.disk.quota_bytes
        if nbytes > limit:
            return False
        while True:
            mine = self._candidates(
                lambda s: s.on_disk and not s.pending_disk and tenant_of(s.record.cache_salt) == tenant,
                self._disk_bytes,
            )
            if sum(c.nbytes for c in mine) + nbytes <= limit:
                return True
            victim = min(mine, key=lambda c: c.value)
            seg = self.segments[victim.seg_id]
            self.disk.delete(victim.seg_id)
            seg.on_disk = False
            self.stats.disk_bytes = self.disk.used_bytes
            if not seg.in_host:
                self._lose(victim.seg_id)

    def sync(self) -> None:
        """Apply the disk evictions the writer thread made (scheduler thread): a segment no tier
        holds any more is lost."""
        while self.writers is not None and self.writers.evicted:
            seg = self.segments.get(self.writers.evicted.popleft())
            if seg is None or not seg.on_disk:
                continue
            seg.on_disk = False
            if not seg.in_host and not seg.pending_disk:
                self._lose(seg.record.seg_id)

    def register(self, record: SegmentRecord) -> None:
        """A segment found on disk, stored by another worker (or by this one before a restart)."""
        if record.seg_id not in self.segments:
            self.segments[record.seg_id] = StoredSegment(record, on_disk=True)
            self.policy.on_access(record.seg_id, record.n_chunks)

    def written_elsewhere(self, seg_id: str) -> bool:
        """Whether another worker process stored this segment (this one found it on the shared disk)."""
        seg = self.segments.get(seg_id)
        return seg is not None and self.disk is not None and seg.record.writer not in ("", self.disk.writer)

    def _disk_only(self, seg_id: str) -> bool:
        """Whether the host chunk cache should keep chunks of this segment: the tiers hold it, on disk only."""
        seg = self.segments.get(seg_id)
        return seg is not None and not seg.in_host

    def _lose(self, seg_id: str, lost: bool = True) -> None:
        seg = self.segments.pop(seg_id, None)
        if seg is None:
            return
        if seg.on_disk:
            self.disk.delete(seg_id)
            self.stats.disk_bytes = self.disk.used_bytes
        if seg.in_host:
            self.stats.host_bytes -= self._host_bytes(seg)
        self.policy.forget(seg_id)
        self.retention.unpin(seg_id)
        self.chunk_cache.drop(seg_id)
        if self.prefetch is not None:
            self.prefetch.discard(seg_id)
        self.stats.lost_segments += lost
        self.on_lost(seg_id)

    def forget_corrupt(self, seg_id: str) -> None:
        """A reader found part of this segment damaged: counted, and removed from every tier (the
        tree recomputes that history next time)."""
        if seg_id in self.segments:
            self.stats.corrupt_segments += 1
            self._lose(seg_id)

    def drop(self, seg_id: str) -> None:
        """Remove a segment from every tier (the tree no longer needs it)."""
        seg = self.segments.get(seg_id)
        if seg is not None and seg.pending_disk:
            self.flush()
        self._lose(seg_id)

    def remove(self, seg_id: str) -> None:
        """Remove a segment from every tier because it was asked for (a forget): like :meth:`drop`,
        not counted as lost."""
        seg = self.segments.get(seg_id)
        if seg is not None and seg.pending_disk:
            self.flush()
        self._lose(seg_id, lost=False)

    def pin(self, seg_id: str, ttl_s: float | None) -> bool:
        """Pin a stored segment's host copy (:meth:`RetentionBook.pin`); False: not in the arena, or over the quota."""
        seg = self.segments.get(seg_id)
        if seg is None or not seg.in_host:
            return False
        return self.retention.pin(seg_id, self._host_bytes(seg), ttl_s)

    def tenant_usage(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tier, tenant label) -> (tokens, bytes) held (:func:`tenant_label`: bounded, the salt hashed)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        c = self.geometry.chunk_tokens
        for s in self.segments.values():
            tenant = tenant_label(tenant_of(s.record.cache_salt))
            for tier, held, nbytes in (("host", s.in_host, self._host_bytes), ("disk", s.on_disk, self._disk_bytes)):
                if held:
                    tokens, total = out.get((tier, tenant), (0, 0))
                    out[(tier, tenant)] = (tokens + s.record.n_chunks * c, total + nbytes(s))
        return out

    def count_tokens(self) -> TierStats:
        """Refresh the per-tier token counts (for metrics) and return the stats."""
        c = self.geometry.chunk_tokens
        self.stats.host_tokens = sum(s.record.n_chunks * c for s in self.segments.values() if s.in_host)
        self.stats.disk_tokens = sum(s.record.n_chunks * c for s in self.segments.values() if s.on_disk)
        self.stats.host_chunk_bytes = self.chunk_cache.stats.bytes
        self.stats.pinned_bytes = self.retention.pinned_bytes
        self.stats.pins_refused = self.retention.refused
        self.stats.tenants = self.tenant_usage()
        if self.disk is not None:
            self.stats.disk_read_seconds, self.stats.disk_verify_seconds = self.disk.read_seconds
        return self.stats

    # --- out -----------------------------------------------------------------------------------
    def tier_of(self, seg_id: str) -> str | None:
        seg = self.segments.get(seg_id)
        if seg is None:
            return None
        return "host" if seg.in_host else ("disk" if seg.on_disk else None)

    def read_ahead(self, seg_id: str) -> bool:
        """Start reading ``seg_id`` whole on the prefetch thread if only the disk holds it (a later
        :meth:`fetch` takes that read); whether a read of it is still in flight."""
        seg = self.segments.get(seg_id)
        if self.prefetch is None or seg is None or seg.in_host or not seg.on_disk:
            return False
        self.prefetch.start(seg_id, lambda: self._read(seg_id, 0, seg.record.n_chunks))
        return self.prefetch.pending(seg_id)

    def pace_reads(self, busy: bool) -> None:
        """Whether other requests are running: a read-ahead then gives way to them (:mod:`~sgl_loopkv.cache.read_pacing`)."""
        if self.prefetch is not None:
            self.prefetch.pacing.set_busy(busy)

    def read_ahead_done(self, seg_id: str) -> bool:
        """Whether a finished read of ``seg_id`` waits for :meth:`fetch` (its KV is in RAM already)."""
        return self.prefetch is not None and self.prefetch.done(seg_id)

    def _read(self, seg_id: str, chunk_lo: int, chunk_hi: int, first: list[int] | None = None) -> PrefetchedRead:
        """The disk read only (verified), timed: inline in :meth:`fetch` or on the prefetch thread
        (the caller's thread does the rest). ``bytes_read`` is the codec's count over the read: a
        chunk-pruned restore's reader reading at the same moment would be counted here too (a
        metric, not a decision, depends on it)."""
        t0, before = time.perf_counter(), self.disk.bytes_read
        try:
            kv = self.disk.read(seg_id, chunk_lo, chunk_hi, first)
        finally:
            self.stats.disk_read_wall_seconds += time.perf_counter() - t0  # any thread: a metric only
        return PrefetchedRead(kv, self.disk.bytes_read - before, time.perf_counter() - t0)

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
        seg = self.segments.get(seg_id)
        c = self.geometry.chunk_tokens
        if seg is None:
            raise CorruptSegment(f"segment {seg_id} is gone")
        if seg.in_host:
            return slice_tokens(seg.host_kv, chunk_lo * c, chunk_hi * c), "host"
        if not seg.on_disk:
            raise CorruptSegment(f"segment {seg_id} has no copy")
        t0 = time.perf_counter()
        with self._disk_read(seg):  # no lock: a file evicted meanwhile by any worker is either read whole or found gone
            read = self.prefetch.take(seg_id) if self.prefetch is not None else None  # raises what its read did
            partial = read is None and skip_chunks is not None and any(skip_chunks)  # read ahead: whole
            if read is None:
                first = [chunk_lo + k for k in skip_chunks] if partial else None
                read = self._read(seg_id, *((chunk_lo, chunk_hi) if partial else (0, seg.record.n_chunks)), first)
            kv = read.kv
            self.stats.disk_bytes_read += read.bytes_read
        self.stats.load_seconds += time.perf_counter() - t0
        self.last_disk_read = (read.bytes_read, read.seconds)
        if partial:
            t = chunk_hi - chunk_lo
            self.stats.disk_bytes_used += (
                sum(t - k for k in skip_chunks) * self.geometry.chunk_tokens * (self.geometry.token_bytes_per_layer)
            )
            return kv, "disk"
        self.stats.disk_bytes_used += kv_nbytes(kv)
        g = self.geometry
        nbytes = kv_nbytes(kv) + g.num_layers * seg.record.n_chunks * g.summary_bytes_per_chunk_layer
        if self._reserve_host(
            nbytes, keep={seg_id, *keep}, tenant=tenant_of(seg.record.cache_salt)
        ):  # promote (the summaries only once it fits)
            if isinstance(kv, PackedKV):  # a shared layer's keys are not its own: read the stored summaries
                summaries = self.disk.read_summaries(seg_id)
            else:  # the verified keys give the summaries back without another read
                summaries = key_summaries(stored_keys(kv), g.chunk_tokens).to(g.summary_dtype)
            seg.host_kv, seg.host_summaries = kv, summaries
            self.chunk_cache.drop(seg_id)  # the whole copy is in the arena now
        return slice_tokens(kv, chunk_lo * c, chunk_hi * c), "disk"

    @contextlib.contextmanager
    def _disk_read(self, seg: StoredSegment) -> Iterator[None]:
        """Around a read of ``seg``'s file: a file gone (evicted by any worker) or damaged is counted
        and the segment forgotten (a damaged file deleted); the tree recomputes that history."""
        try:
            yield
        except SegmentGone:
            self.stats.gone_segments += 1
            seg.on_disk = False
            self._lose(seg.record.seg_id)
            raise
        except CorruptSegment:
            self.stats.corrupt_segments += 1
            self._lose(seg.record.seg_id)
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
        seg = self.segments.get(seg_id)
        if seg is None:
            raise CorruptSegment(f"segment {seg_id} is gone")
        if not seg.in_host and seg.on_disk:
            before = self.disk.bytes_read
            with self._disk_read(seg):
                fd, header = self.disk.open_for_chunks(seg_id)
            if "side" not in header:
                summaries = self.chunk_cache.summaries_of(seg_id, layers) if cache_summaries else None
                try:
                    if summaries is None:
                        with self._disk_read(seg):
                            summaries = self.disk.codec.read_summaries(fd, seg_id, layers, header)
                        if cache_summaries:
                            self.chunk_cache.keep_summaries(seg_id, layers, summaries)
                except BaseException:
                    os.close(fd)
                    raise
                finally:  # admission reads (header, the scored layers' summaries) are reads too
                    self.stats.disk_bytes_read += self.disk.bytes_read - before
                return ChunkSource(None, fd, header, summaries[:, chunk_lo:chunk_hi].float(), "disk")
            os.close(fd)
        kv, tier = self.fetch(seg_id, chunk_lo, chunk_hi, keep=keep)
        summaries = seg.host_summaries if seg.host_summaries is not None else self.disk.read_summaries(seg_id)
        return ChunkSource(kv, None, None, summaries[layers, chunk_lo:chunk_hi].float(), tier)

    def touch(self, seg_id: str, n_chunks: int, importance: torch.Tensor | None = None) -> None:
        if seg_id in self.segments:
            self.policy.on_access(seg_id, n_chunks, importance)

    def touch_disk(self, seg_ids: Iterable[str]) -> None:
        """A turn used these segments: the shared tier's LRU order (file mtimes) sees it too."""
        if self.disk is not None:
            self.disk.touch([s for s in seg_ids if s in self.segments and self.segments[s].on_disk])
