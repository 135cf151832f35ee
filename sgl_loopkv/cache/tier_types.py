"""What the tiers keep per segment and count: shared by the store, its disk writers, the metrics and
the chunk-pruned restores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sgl_loopkv.cache.packed import PackedKV
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.segment_record import SegmentRecord


class ChunkSource(NamedTuple):
    """What a chunk-pruned restore reads a range of a segment's chunks from
    (:meth:`TieredKVStore.chunk_source`): the host tier's KV of the range (``host_kv[layer]`` ->
    [2, T, H, D]) or, for a disk hit, an open segment file ``fd`` (the caller closes it) and its
    verified ``header``; the range's key ``summaries`` of the scored layers [len(layers), m, H, 2, D]
    float32; the ``tier`` it came from."""

    host_kv: object | None
    fd: int | None
    header: dict | None
    summaries: torch.Tensor
    tier: str


@dataclass(slots=True)
class StoredSegment:
    record: SegmentRecord
    host_kv: torch.Tensor | QuantKV | PackedKV | None = None  # [L, 2, T, H, D], int8, or pairs sharing rows
    host_summaries: torch.Tensor | None = None  # [L, m, H, 2, D] in geometry.summary_dtype
    on_disk: bool = False
    pending_disk: bool = False

    @property
    def in_host(self) -> bool:
        return self.host_kv is not None


@dataclass(slots=True)
class TierStats:
    """Counters for metrics and benchmarks (bytes and tokens)."""

    host_bytes: int = 0
    disk_bytes: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    disk_bytes_read: int = 0
    disk_bytes_used: int = 0  # KV bytes the reads delivered to the device pool (excl. padding/headers)
    load_seconds: float = 0.0
    disk_read_seconds: float = 0.0  # the disk codec's preads (summed over threads) and checksums
    disk_verify_seconds: float = 0.0
    disk_read_wall_seconds: float = 0.0  # whole reads of segments (read, verify, the tensors built from them)
    read_naps: int = 0  # naps a read-ahead took to give way to running requests (read_pacing)
    read_nap_seconds: float = 0.0
    corrupt_segments: int = 0
    lost_segments: int = 0
    gone_segments: int = 0  # disk segments found evicted by another worker when read (recomputed)
    disk_write_errors: int = 0  # segment writes the disk refused (full, I/O error): not stored on disk
    disk_full_writes: int = 0  # of those, refused for a full filesystem (ENOSPC, EDQUOT): quota lowered
    shared_segments: int = 0  # segments stored with layer pairs sharing one row (Krul)
    host_tokens: int = 0  # tokens held per tier (bytes / tokens = stored bytes per token)
    disk_tokens: int = 0
    host_chunk_bytes: int = 0  # the host chunk cache's (chunks of disk-only segments, in the arena's free room)
    disk_expired: int = 0  # segments the disk TTL (--loopkv-lifecycle-disk-ttl) deleted, by this worker
    forgets: int = 0  # forgets (POST /loopkv/forget) that removed something here
    pinned_bytes: int = 0  # host bytes pinned by "retain": "pin" requests
    pins_refused: int = 0  # pins over --loopkv-lifecycle-pin-bytes: stored unpinned
    tenants: dict = field(default_factory=dict)  # (tier, tenant metrics label) -> (tokens, bytes)
