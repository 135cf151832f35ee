"""Tier counters on SGLang's Prometheus endpoint (``--enable-metrics``): bytes per tier, hit
tokens per tier, disk bytes read vs used (read amplification), load time, corrupt segments.

Created in the scheduler process after SGLang has set ``PROMETHEUS_MULTIPROC_DIR``, like SGLang's
own scheduler metrics, so ``GET /metrics`` of the HTTP server shows them.
"""

from __future__ import annotations

from sgl_loopkv.cache.store import TierStats


class TierMetrics:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._last = TierStats()
        if not enabled:
            return
        from prometheus_client import Counter, Gauge

        self.bytes = Gauge("loopkv_tier_bytes", "Bytes held per tier", ["tier"], multiprocess_mode="mostrecent")
        self.hits = Counter("loopkv_hit_tokens", "Cached prompt tokens served, by the tier they came from", ["tier"])
        self.disk_read = Counter("loopkv_disk_bytes_read", "Bytes read from the disk tier")
        self.disk_used = Counter(
            "loopkv_disk_bytes_used", "KV bytes the disk reads delivered (read amplification = read / used)"
        )
        self.load_seconds = Counter("loopkv_load_seconds", "Seconds spent fetching and starting tier loads")
        self.corrupt = Counter("loopkv_corrupt_segments", "Stored segments rejected by their checksums")

    def publish(self, stats: TierStats, device_hit_tokens: int = 0) -> None:
        if not self.enabled:
            return
        self.bytes.labels(tier="host").set(stats.host_bytes)
        self.bytes.labels(tier="disk").set(stats.disk_bytes)
        last = self._last
        for tier in ("host", "disk"):
            self.hits.labels(tier=tier).inc(stats.hit_tokens[tier] - last.hit_tokens[tier])
        if device_hit_tokens:
            self.hits.labels(tier="device").inc(device_hit_tokens)
        self.disk_read.inc(stats.disk_bytes_read - last.disk_bytes_read)
        self.disk_used.inc(stats.disk_bytes_used - last.disk_bytes_used)
        self.load_seconds.inc(stats.load_seconds - last.load_seconds)
        self.corrupt.inc(stats.corrupt_segments - last.corrupt_segments)
        self._last = TierStats(
            stats.host_bytes,
            stats.disk_bytes,
            dict(stats.hit_tokens),
            stats.disk_bytes_read,
            stats.disk_bytes_used,
            stats.load_seconds,
            stats.corrupt_segments,
            stats.lost_segments,
        )
