"""What a chunk-pruned restore read, used and waited for (:class:`PrunedStats`): per restore, in the
request's ``cached_tokens_details.pruned``, and summed over restores for ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrunedStats:
    """Per restore (and summed over restores for ``/metrics``). Bytes are pool-dtype KV bytes,
    ``disk_bytes_read`` what the disk reads returned (extent padding included)."""

    bytes_loaded: int = 0  # copied into the pool (host or disk)
    cached_bytes: int = 0  # of those, disk chunks taken from the host chunk cache instead of read
    bytes_used: int = 0  # of those, the chunks attention read in the period they were loaded for
    disk_bytes_read: int = 0  # all of it, admission's key summaries included
    summary_bytes_read: int = 0  # of those, admission's: the key summaries of the layers it scores at
    prefetched_bytes: int = 0  # loaded ahead for the next period's layers
    wasted_prefetch_bytes: int = 0  # prefetched, then not selected by that period
    io_wait_s: float = 0.0  # the forward waiting for reads
    # the reads waiting for the forward: during the prefill, time with every read of the restore done
    # and the next not yet queued (the next period not selected yet: ContiguousKV's compute wait)
    compute_wait_s: float = 0.0
    reader_busy_s: float = 0.0  # the reader copying or reading
    selections: int = 0
    kept_chunks: int = 0  # summed over selections
    scored_chunks: int = 0
    bad_extents: int = 0  # failed their checksum: left out, counted
    decode_selections: int = 0  # decode-time re-selections (query drifted past tau)
    recalled_bytes: int = 0  # chunks recalled into the page cache during decode
    cache_tokens: int = 0  # device-pool slots of the page cache (per restore; summed over restores)
    overlap_sum: float = 0.0  # per selection after a period's first: share of its chunks the previous period kept
    overlaps: int = 0
    restores: int = 0  # restores run (the sum over restores only; 0 in one restore's own stats)

    @property
    def inter_period_overlap(self) -> float:
        return self.overlap_sum / self.overlaps if self.overlaps else 0.0

    @property
    def read_amplification(self) -> float:
        return self.disk_bytes_read / self.bytes_used if self.bytes_used else 0.0

    def add(self, other: PrunedStats) -> None:
        for f in self.__slots__:
            setattr(self, f, getattr(self, f) + getattr(other, f))
