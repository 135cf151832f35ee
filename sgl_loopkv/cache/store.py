"""The host and disk tiers behind one object: segments in, segments out, quotas held.

A segment enters through :meth:`TieredKVStore.put` (host arena, then written through to disk
in the background) and leaves the last tier only when a quota forces it; then ``on_lost(seg_id)``
tells the radix tree. The host arena is private and evicts the least valuable segment first
(:mod:`sgl_loopkv.cache.value`). The disk tier is shared with the other workers of a cluster
(:mod:`sgl_loopkv.cache.disk`): it evicts the least recently used segment of *any* worker, and a
worker learns of others' segments by finding them (:meth:`TieredKVStore.register`) and of their
evictions when a read finds a file gone (recomputed, like a corrupt one). A write the disk refuses
is counted (``disk_write_errors``) and logged, and the segment stays where it was (host arena) or is
not stored; a full disk also lowers the tier's quota to what fits. The way out (fetches, reads ahead,
chunk sources) is :mod:`sgl_loopkv.cache.store_reads`; the room in each tier :mod:`sgl_loopkv.cache.store_room`.

All calls come from the scheduler thread. The background threads belong to the store's I/O
controller (:mod:`sgl_loopkv.cache.io_controller`): the disk writers touch only the disk store, the
``pending`` flags, the counters and the evictions that :meth:`TieredKVStore.sync` drains
(:mod:`sgl_loopkv.cache.disk_writer`); the read-ahead thread only reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import torch

from sgl_loopkv.cache.chunk_cache import HostChunkCache
from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.disk_dir import DirectoryLock
from sgl_loopkv.cache.io_controller import IOController
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.packed import PackedKV, kv_nbytes, quantize_rows
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.read_buffers import ReadBuffers
from sgl_loopkv.cache.retention import RetentionBook, tenant_of
from sgl_loopkv.cache.segment_record import LAYER_GROUP, SegmentRecord
from sgl_loopkv.cache.store_reads import TierReads
from sgl_loopkv.cache.store_room import TierRoom, host_bytes
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
        io: IOController | None = None,
    ):
        """``io``: the owner of its background threads (:mod:`~sgl_loopkv.cache.io_controller`), its
        own if not given; started here, stopped by :meth:`close`."""
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
        self.io = io or IOController()
        self.buffers = ReadBuffers()  # rows read from disk and gathered from the pool, in reused memory
        self.disk = self.prefetch = self.writers = None
        if disk_dir:
            self.disk = DiskSegmentStore(
                disk_dir,
                disk_quota_bytes,
                geometry,
                layer_group,
                disk_cipher,
                readers=self.io.make_preads(),
                buffers=self.buffers,
            )
            self.stats.disk_bytes = self.disk.used_bytes
            # Whole-segment reads ahead of admission, off the scheduler thread (--loopkv-tier-disk-read background)
            self.prefetch = self.io.make_prefetch() if read_ahead else None
            self.writers = self.io.make_writers(self, disk_ttl_s)  # and the TTL sweep (cache.disk_writer)
        self.reads, self.room = TierReads(self), TierRoom(self)
        self.io.start()

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
            to_disk = self.room.tenant_disk_room(tenant, self.disk.file_bytes(record.n_chunks, len(record.token_ids)))
        in_host = self.room.reserve_host(nbytes, tenant=tenant)
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
        """Stop every background thread (:meth:`IOController.close`: the queued writes first), then
        let the directory go."""
        self.io.close()
        if self.dir_lock is not None:
            self.dir_lock.release()

    # --- room (cache.store_room) ---------------------------------------------------------------
    def _host_bytes(self, seg: StoredSegment) -> int:
        return host_bytes(seg)

    def sync(self) -> None:
        """Apply the disk evictions the writer thread made (scheduler thread): a segment no tier
        holds any more is lost."""
        for seg_id in self.io.evicted():
            seg = self.segments.get(seg_id)
            if seg is None or not seg.on_disk:
                continue
            seg.on_disk = False
            if not seg.in_host and not seg.pending_disk:
                self.lose(seg.record.seg_id)

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

    def lose(self, seg_id: str, lost: bool = True) -> None:
        """``seg_id`` leaves every tier, and the tree hears of it (``on_lost``); ``lost``: counted."""
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
            self.lose(seg_id)

    def drop(self, seg_id: str) -> None:
        """Remove a segment from every tier (the tree no longer needs it)."""
        seg = self.segments.get(seg_id)
        if seg is not None and seg.pending_disk:
            self.flush()
        self.lose(seg_id)

    def remove(self, seg_id: str) -> None:
        """Remove a segment from every tier because it was asked for (a forget): like :meth:`drop`,
        not counted as lost."""
        seg = self.segments.get(seg_id)
        if seg is not None and seg.pending_disk:
            self.flush()
        self.lose(seg_id, lost=False)

    def pin(self, seg_id: str, ttl_s: float | None) -> bool:
        """Pin a stored segment's host copy (:meth:`RetentionBook.pin`); False: not in the arena, or over the quota."""
        seg = self.segments.get(seg_id)
        if seg is None or not seg.in_host:
            return False
        return self.retention.pin(seg_id, self._host_bytes(seg), ttl_s)

    def tenant_usage(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tier, tenant label) -> (tokens, bytes) held (:meth:`TierRoom.tenant_usage`)."""
        return self.room.tenant_usage()

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
        if self.prefetch is not None:
            pacing = self.prefetch.pacing
            self.stats.read_naps, self.stats.read_nap_seconds = pacing.naps, pacing.nap_seconds
        return self.stats

    # --- out -----------------------------------------------------------------------------------
    def tier_of(self, seg_id: str) -> str | None:
        seg = self.segments.get(seg_id)
        if seg is None:
            return None
        return "host" if seg.in_host else ("disk" if seg.on_disk else None)

    def read_ahead(self, seg_id: str) -> bool:
        """Start a whole read of a disk-only ``seg_id`` on the read-ahead thread (:meth:`TierReads.read_ahead`)."""
        return self.reads.read_ahead(seg_id)

    def pace_reads(self, busy: bool) -> None:
        """Whether other requests are running: a read-ahead then gives way to them (:mod:`~sgl_loopkv.cache.read_pacing`)."""
        if self.prefetch is not None:
            self.prefetch.pacing.set_busy(busy)

    def read_ahead_done(self, seg_id: str) -> bool:
        """Whether a finished read of ``seg_id`` waits for :meth:`fetch` (its KV is in RAM already)."""
        return self.prefetch is not None and self.prefetch.done(seg_id)

    def fetch(
        self,
        seg_id: str,
        chunk_lo: int,
        chunk_hi: int,
        skip_chunks: list[int] | None = None,
        keep: Collection[str] = (),
    ) -> tuple[torch.Tensor, str]:
        """KV [L, 2, T, H, D] of chunks [chunk_lo, chunk_hi) and its tier (:meth:`TierReads.fetch`)."""
        return self.reads.fetch(seg_id, chunk_lo, chunk_hi, skip_chunks, keep)

    def chunk_source(
        self, seg_id: str, chunk_lo: int, chunk_hi: int, layers: list[int], keep=(), cache_summaries: bool = False
    ) -> ChunkSource:
        """What a chunk-pruned restore reads those chunks from (:meth:`TierReads.chunk_source`)."""
        return self.reads.chunk_source(seg_id, chunk_lo, chunk_hi, layers, keep, cache_summaries)

    def touch(self, seg_id: str, n_chunks: int, importance: torch.Tensor | None = None) -> None:
        if seg_id in self.segments:
            self.policy.on_access(seg_id, n_chunks, importance)

    def touch_disk(self, seg_ids: Iterable[str]) -> None:
        """A turn used these segments: the shared tier's LRU order (file mtimes) sees it too."""
        if self.disk is not None:
            self.disk.touch([s for s in seg_ids if s in self.segments and self.segments[s].on_disk])
