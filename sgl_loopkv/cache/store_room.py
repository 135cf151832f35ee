"""Room in the tiers (:class:`TierRoom`, one per :class:`~sgl_loopkv.cache.store.TieredKVStore`):
which segments leave the host arena for a new one, which of a tenant's leave the disk to keep it
within its share, and what each tenant holds. The choice of a victim is the retention book's
(:meth:`~sgl_loopkv.cache.retention.RetentionBook.victim`: pins kept, an over-share tenant's first,
least valuable first); this class applies it to the store's segments and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from sgl_loopkv.cache.packed import kv_nbytes
from sgl_loopkv.cache.retention import Candidate, tenant_label, tenant_of
from sgl_loopkv.cache.tier_types import StoredSegment

if TYPE_CHECKING:
    from sgl_loopkv.cache.store import TieredKVStore


def host_bytes(seg: StoredSegment) -> int:
    """Bytes of ``seg``'s host copy (KV and summaries)."""
    return kv_nbytes(seg.host_kv) + seg.host_summaries.numel() * seg.host_summaries.element_size()


class TierRoom:
    """Called from the scheduler thread only."""

    def __init__(self, store: TieredKVStore):
        self.store = store

    def disk_bytes(self, seg: StoredSegment) -> int:
        return self.store.disk.file_bytes(seg.record.n_chunks, len(seg.record.token_ids))

    def reserve_host(self, nbytes: int, keep: Collection[str] = (), tenant: str | None = None) -> bool:
        """Room for a segment of ``nbytes`` (of ``tenant``) in the arena, counted as held (the caller
        puts it there): the chunk cache gives its room first (copies of disk extents), then segments
        but ``keep`` and pinned ones go, an over-share tenant's first, least valuable first
        (:meth:`RetentionBook.victim`)."""
        store = self.store
        stats, quota, retention = store.stats, store.host_quota, store.retention
        if nbytes > quota:
            return False
        # the scheduler thread is the only one that adds to the cache or the arena: no lock across both
        store.chunk_cache.shrink(max(quota - stats.host_bytes - nbytes, 0))
        while stats.host_bytes + nbytes > quota:
            pick = retention.victim(
                self._candidates(lambda s: s.in_host and s.record.seg_id not in keep, host_bytes),
                quota,
                retention.host_share,
                tenant,
                nbytes,
            )
            if pick is None:
                return False
            victim = store.segments[pick.seg_id]
            if victim.pending_disk:
                store.flush()  # never drop the only copy while its disk write is queued
            stats.host_bytes -= host_bytes(victim)
            victim.host_kv = victim.host_summaries = None
            if not victim.on_disk:
                store.lose(victim.record.seg_id)
        stats.host_bytes += nbytes
        return True

    def _candidates(self, which: Callable[[StoredSegment], bool], nbytes: Callable[[StoredSegment], int]):
        value = self.store.policy.value
        return [
            Candidate(s.record.seg_id, tenant_of(s.record.cache_salt), nbytes(s), value(s.record.seg_id))
            for s in self.store.segments.values()
            if which(s)
        ]

    def tenant_disk_room(self, tenant: str, nbytes: int) -> bool:
        """With a disk share: delete ``tenant``'s least valuable disk segments (this worker's view of the
        shared tier) until ``nbytes`` more stay within its share; False when they cannot. Beyond the
        share the disk's own LRU eviction (any worker's segments) still holds the whole quota."""
        store = self.store
        disk = store.disk
        limit = store.retention.disk_share * disk.quota_bytes
        if nbytes > limit:
            return False
        while True:
            mine = self._candidates(
                lambda s: s.on_disk and not s.pending_disk and tenant_of(s.record.cache_salt) == tenant,
                self.disk_bytes,
            )
            if sum(c.nbytes for c in mine) + nbytes <= limit:
                return True
            victim = min(mine, key=lambda c: c.value)
            seg = store.segments[victim.seg_id]
            disk.delete(victim.seg_id)
            seg.on_disk = False
            store.stats.disk_bytes = disk.used_bytes
            if not seg.in_host:
                store.lose(victim.seg_id)

    def tenant_usage(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tier, tenant label) -> (tokens, bytes) held (:func:`tenant_label`: bounded, the salt hashed)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        c = self.store.geometry.chunk_tokens
        for s in self.store.segments.values():
            tenant = tenant_label(tenant_of(s.record.cache_salt))
            for tier, held, nbytes in (("host", s.in_host, host_bytes), ("disk", s.on_disk, self.disk_bytes)):
                if held:
                    tokens, total = out.get((tier, tenant), (0, 0))
                    out[(tier, tenant)] = (tokens + s.record.n_chunks * c, total + nbytes(s))
        return out
