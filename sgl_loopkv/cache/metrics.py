"""Tier counters on SGLang's Prometheus endpoint (``--enable-metrics``): bytes per tier, hit
tokens per tier, disk bytes read vs used (read amplification), load time, corrupt segments, refused disk writes
(and those refused for a full disk), segments stored with shared layer pairs.

Created in the scheduler process after SGLang has set ``PROMETHEUS_MULTIPROC_DIR``, like SGLang's
own scheduler metrics, so ``GET /metrics`` of the HTTP server shows them.
"""

from __future__ import annotations

from dataclasses import replace

from sgl_loopkv.cache.tier_types import TierStats


class TierMetrics:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._last = TierStats()
        if not enabled:
            return
        from prometheus_client import Counter, Gauge

        self.bytes = Gauge("loopkv_tier_bytes", "Bytes held per tier", ["tier"], multiprocess_mode="mostrecent")
        self.tokens = Gauge("loopkv_tier_tokens", "Tokens held per tier", ["tier"], multiprocess_mode="mostrecent")
        self.hits = Counter("loopkv_hit_tokens", "Cached prompt tokens served, by the tier they came from", ["tier"])
        self.disk_read = Counter("loopkv_disk_bytes_read", "Bytes read from the disk tier")
        self.disk_used = Counter(
            "loopkv_disk_bytes_used", "KV bytes the disk reads delivered (read amplification = read / used)"
        )
        self.load_seconds = Counter("loopkv_load_seconds", "Seconds spent fetching and starting tier loads")
        self.corrupt = Counter("loopkv_corrupt_segments", "Stored segments rejected by their checksums")
        self.write_errors = Counter(
            "loopkv_disk_write_errors", "Segment writes the disk refused (full, I/O error): not stored on disk"
        )
        self.disk_full = Counter(
            "loopkv_disk_full_writes", "Of those, refused for a full filesystem: the disk tier's quota was lowered"
        )
        self.shared = Counter("loopkv_shared_segments", "Segments stored with layer pairs sharing one row (Krul)")
        self.gone = Counter(
            "loopkv_gone_segments", "Disk segments found evicted (by any worker of the shared tier) when read"
        )
        self.expired = Counter(
            "loopkv_disk_expired_segments", "Disk segments deleted by --loopkv-lifecycle-disk-ttl (this worker)"
        )
        self.forgets = Counter("loopkv_forgets", "Forgets (POST /loopkv/forget) that removed stored KV")
        self.tenant_bytes = Gauge(
            "loopkv_tenant_bytes", "Bytes held per tier and tenant (salt hash bucket)", ["tier", "tenant"],
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.tenant_tokens = Gauge(
            "loopkv_tenant_tokens", "Tokens held per tier and tenant (salt hash bucket)", ["tier", "tenant"],
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.pinned = Gauge("loopkv_pinned_bytes", "Host bytes pinned by retain: pin", multiprocess_mode="mostrecent")
        self.pins_refused = Counter("loopkv_pins_refused", "Pins over --loopkv-lifecycle-pin-bytes, stored unpinned")
        self._tenant_labels: set[tuple[str, str]] = set()
        self.restores = Counter("loopkv_restores", "Histories restored from the host/disk tiers")
        self.restore_recompute = Gauge(
            "loopkv_restore_recompute_fraction",
            "Share of restored token-layers recomputed instead of loaded (all restores so far)",
            multiprocess_mode="mostrecent",
        )
        self.restore_last_split = Gauge(
            "loopkv_restore_last_front_tokens",
            "Front tokens recomputed by the latest restore, at its first and last layer",
            ["layer"],
            multiprocess_mode="mostrecent",
        )
        self.restore_seconds = Counter(
            "loopkv_restore_seconds",
            "Resume time by part (restore.restorer.STAGES): lookup, plan, fetch, alloc, recompute on the scheduler "
            "thread; decode, copy (load = both) on the loader thread; bubble = the forward waiting for a load",
            ["part"],
        )
        self.disk_seconds = Counter(
            "loopkv_disk_seconds",
            "Disk tier reads by part: read (preads, summed over threads), verify (crc32 or decryption), total (whole "
            "segment reads), nap (read-aheads giving way to running requests)",
            ["part"],
        )
        self.read_naps = Counter("loopkv_read_ahead_naps", "Naps a disk read-ahead took while other requests ran")
        self._last_restore = None
        self.pruned = Counter(
            "loopkv_prefix_bytes",
            "Chunk-pruned restores: KV bytes loaded into the pool (of which taken from the host chunk cache), used by "
            "attention, read from disk, prefetched "
            "for the next period, prefetched and then not selected, recalled during decode (freekv)",
            ["part"],
        )
        self.pruned_seconds = Counter(
            "loopkv_prefix_seconds",
            "Chunk-pruned restores: the forward waiting for reads (io_wait), the reads waiting for the forward's next selection (compute_wait), the reader busy",
            ["part"],
        )
        self.pruned_restores = Counter(
            "loopkv_prefix_restores", "Chunk-pruned restores run (counted when their turn's prefill is over)"
        )
        self.pruned_bad = Counter("loopkv_prefix_bad_extents", "Chunk extents that failed their checksum (left out)")
        self.pruned_fraction = Gauge(
            "loopkv_prefix_kept_fraction",
            "Share of scored history chunks the selections kept (all pruned restores so far)",
            multiprocess_mode="mostrecent",
        )
        self.pruned_overlap = Gauge(
            "loopkv_prefix_inter_period_overlap",
            "Mean share of a period's selected chunks the previous period had kept (prefetched)",
            multiprocess_mode="mostrecent",
        )
        self._last_pruned = None

    def publish_restore(self, stats) -> None:
        """Restorer counters (:class:`sgl_loopkv.restore.restorer.RestoreStats`); bubble = time the
        forward waited for a layer still being copied."""
        if not self.enabled:
            return
        last = self._last_restore or type(stats)()
        self.restores.inc(stats.restores - last.restores)
        self.restore_recompute.set(stats.recompute_fraction)
        if stats.last_plan:
            self.restore_last_split.labels(layer="first").set(stats.last_plan[0])
            self.restore_last_split.labels(layer="last").set(stats.last_plan[-1])
        for part, now in stats.seconds.items():
            self.restore_seconds.labels(part=part).inc(max(now - last.seconds.get(part, 0.0), 0.0))
        self._last_restore = stats.snapshot()

    def publish_pruned(self, stats) -> None:
        """Chunk-pruned restore totals (:class:`sgl_loopkv.cache.pruned.PrunedStats`); read amplification =
        disk_read / used (``summary_read``: the part of disk_read that admissions read, key summaries)."""
        if not self.enabled:
            return
        last = self._last_pruned or type(stats)()
        for part, name in (
            ("loaded", "bytes_loaded"),
            ("cached", "cached_bytes"),
            ("used", "bytes_used"),
            ("disk_read", "disk_bytes_read"),
            ("summary_read", "summary_bytes_read"),
            ("prefetched", "prefetched_bytes"),
            ("wasted_prefetch", "wasted_prefetch_bytes"),
            ("recalled", "recalled_bytes"),
        ):
            self.pruned.labels(part=part).inc(max(getattr(stats, name) - getattr(last, name), 0))
        self.pruned_seconds.labels(part="io_wait").inc(max(stats.io_wait_s - last.io_wait_s, 0.0))
        self.pruned_seconds.labels(part="compute_wait").inc(max(stats.compute_wait_s - last.compute_wait_s, 0.0))
        self.pruned_seconds.labels(part="reader").inc(max(stats.reader_busy_s - last.reader_busy_s, 0.0))
        self.pruned_bad.inc(max(stats.bad_extents - last.bad_extents, 0))
        self.pruned_restores.inc(max(stats.restores - last.restores, 0))
        if stats.scored_chunks:
            self.pruned_fraction.set(stats.kept_chunks / stats.scored_chunks)
        self.pruned_overlap.set(stats.inter_period_overlap)
        self._last_pruned = type(stats)()
        self._last_pruned.add(stats)

    def publish(self, stats: TierStats, device_hit_tokens: int = 0) -> None:
        if not self.enabled:
            return
        self.bytes.labels(tier="host").set(stats.host_bytes)
        self.bytes.labels(tier="disk").set(stats.disk_bytes)
        self.bytes.labels(tier="host_chunks").set(stats.host_chunk_bytes)
        self.tokens.labels(tier="host").set(stats.host_tokens)
        self.tokens.labels(tier="disk").set(stats.disk_tokens)
        last = self._last
        for tier in ("host", "disk"):
            self.hits.labels(tier=tier).inc(stats.hit_tokens[tier] - last.hit_tokens[tier])
        if device_hit_tokens:
            self.hits.labels(tier="device").inc(device_hit_tokens)
        self.disk_read.inc(stats.disk_bytes_read - last.disk_bytes_read)
        self.disk_used.inc(stats.disk_bytes_used - last.disk_bytes_used)
        self.load_seconds.inc(stats.load_seconds - last.load_seconds)
        self.disk_seconds.labels(part="read").inc(max(stats.disk_read_seconds - last.disk_read_seconds, 0.0))
        self.disk_seconds.labels(part="verify").inc(max(stats.disk_verify_seconds - last.disk_verify_seconds, 0.0))
        self.disk_seconds.labels(part="total").inc(max(stats.disk_read_wall_seconds - last.disk_read_wall_seconds, 0.0))
        self.disk_seconds.labels(part="nap").inc(max(stats.read_nap_seconds - last.read_nap_seconds, 0.0))
        self.read_naps.inc(max(stats.read_naps - last.read_naps, 0))
        self.corrupt.inc(stats.corrupt_segments - last.corrupt_segments)
        self.write_errors.inc(stats.disk_write_errors - last.disk_write_errors)
        self.disk_full.inc(stats.disk_full_writes - last.disk_full_writes)
        self.shared.inc(stats.shared_segments - last.shared_segments)
        self.gone.inc(stats.gone_segments - last.gone_segments)
        self.expired.inc(stats.disk_expired - last.disk_expired)
        self.forgets.inc(stats.forgets - last.forgets)
        self.pinned.set(stats.pinned_bytes)
        self.pins_refused.inc(stats.pins_refused - last.pins_refused)
        for key in self._tenant_labels - stats.tenants.keys():  # a bucket emptied: 0, not its last value
            self.tenant_tokens.labels(*key).set(0)
            self.tenant_bytes.labels(*key).set(0)
        for key, (tokens, nbytes) in stats.tenants.items():
            self.tenant_tokens.labels(*key).set(tokens)
            self.tenant_bytes.labels(*key).set(nbytes)
        self._tenant_labels |= stats.tenants.keys()
        # what the next publish subtracts: a copy of the counters (not the live object, which the
        # store keeps counting into)
        self._last = replace(stats, hit_tokens=dict(stats.hit_tokens), tenants={})
