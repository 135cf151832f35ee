"""Chunks of disk-only segments kept in the host arena's free room (ContiguousKV's attention-guided
chunk cache).

A chunk-pruned restore from disk reads only the chunks a new turn selects, so the arena never gets
the segment whole (a full load promotes the segment it read). What it read is offered here instead,
per (segment, layer, chunk), and the next restore of that history takes those chunks from RAM and
reads only the rest. What stays is decided by the tiers' value policy at chunk granularity: the
score of a chunk is ContiguousKV's S_j = I_j x F_j (decayed attention importance x access count,
:class:`sgl_loopkv.cache.value.AttentionValuePolicy`), so chunks the turns attended to heavily and
often outlive the ones read once. An offered chunk takes the place of cached chunks worth less than
it, never of one worth as much or more.

The cache only lives in room the arena's segments do not use: a segment that needs room takes it
from the cache first (everything here is a copy of a disk extent, the segments may be the only
copy). The scheduler thread changes it (offers after a batch's outputs, room for segments); the
chunk reader thread takes from it during a prefill, so every call holds one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class _Segment:
    """One segment's cached chunks: per layer, chunk -> its rows [2, c, H, D] (pool dtype)."""

    layers: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)

    def chunks(self) -> set[int]:
        return {j for per_layer in self.layers.values() for j in per_layer}


@dataclass(slots=True)
class ChunkCacheStats:
    bytes: int = 0  # held now (what restores took from here: their ``PrunedStats.cached_bytes``)
    refused_bytes: int = 0  # offered, not kept: no room among chunks worth less


class HostChunkCache:
    """``room()``: bytes the arena can give the cache now (its quota minus its segments' bytes),
    evaluated under :attr:`lock`. ``value(seg_id, chunks)``: per-chunk value [len(chunks)] (higher
    stays longer). ``alive(seg_id)``: whether chunks of the segment are still worth keeping (offers
    arrive after the restore: the tiers may have lost the segment, or hold it whole in the arena now)."""

    def __init__(
        self,
        room: Callable[[], int],
        value: Callable[[str, torch.Tensor], torch.Tensor],
        alive: Callable[[str], bool] = lambda seg_id: True,
    ):
        self.room, self.value, self.alive = room, value, alive
        self.lock = threading.RLock()
        self.segments: dict[str, _Segment] = {}
        # a disk admission's key summaries of the scored layers, per segment with chunks here: a warm
        # restore of the history then reads nothing from disk
        self.summaries: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.stats = ChunkCacheStats()

    # --- the reader's side -------------------------------------------------------------------------
    def take(self, seg_id: str, layers: range, chunks: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """The chunks (ascending segment-local ids) cached at every layer of ``layers``, and per layer
        their rows [2, n * c, H, D] in that order (copies: an eviction afterwards takes nothing away)."""
        with self.lock:
            seg = self.segments.get(seg_id)
            if seg is None:
                return [], []
            per = [seg.layers.get(layer, {}) for layer in layers]
            hit = [j for j in chunks if all(j in d for d in per)]
            if not hit:
                return [], []
            return hit, [torch.cat([d[j] for j in hit], dim=1) for d in per]

    def offer(self, seg_id: str, layers: range, chunks: list[int], rows: list[torch.Tensor]) -> int:
        """Keep what is worth it of ``chunks`` (ascending segment-local ids) read for ``layers``;
        ``rows[i]`` is layer ``layers[i]``'s [2, n * c, H, D] (or [2, n, c, H, D]: a disk read's
        view, which each kept chunk is copied out of). Returns the bytes kept."""
        if not chunks:
            return 0
        per_chunk = [r.reshape(2, len(chunks), -1, *r.shape[-2:]) for r in rows]  # [2, n, c, H, D]
        unit = sum(r[:, 0].numel() * r.element_size() for r in per_chunk)  # one chunk, every layer offered
        values = self.value(seg_id, torch.tensor(chunks))
        kept = 0
        with self.lock:
            if not self.alive(seg_id):  # lost, or whole in the arena: its chunks would never be asked for
                return 0
            for i in torch.argsort(values, descending=True, stable=True).tolist():
                j = chunks[i]
                seg = self.segments.get(seg_id)
                new = [
                    (layer, r)
                    for layer, r in zip(layers, per_chunk)
                    if seg is None or j not in seg.layers.get(layer, {})
                ]
                nbytes = unit * len(new) // len(per_chunk)
                if not new:
                    continue
                if not self._make_room(nbytes, float(values[i]), exclude=(seg_id, j)):
                    self.stats.refused_bytes += nbytes
                    continue
                seg = self.segments.setdefault(seg_id, _Segment())
                for layer, r in new:
                    seg.layers.setdefault(layer, {})[j] = r[:, i].clone()
                self.stats.bytes += nbytes
                kept += nbytes
        return kept

    def summaries_of(self, seg_id: str, layers: list[int]) -> torch.Tensor | None:
        with self.lock:
            hit = self.summaries.get(seg_id)
            return hit[1] if hit is not None and hit[0] == tuple(layers) else None

    def keep_summaries(self, seg_id: str, layers: list[int], summaries: torch.Tensor) -> None:
        """Kept while the segment has chunks here (they go with its last chunk), if there is room."""
        nbytes = summaries.numel() * summaries.element_size()
        with self.lock:
            self._drop_summaries(seg_id)
            if self.stats.bytes + nbytes <= self.room():
                self.summaries[seg_id] = (tuple(layers), summaries.clone())
                self.stats.bytes += nbytes

    # --- the store's side --------------------------------------------------------------------------
    def shrink(self, nbytes: int) -> None:
        """Hold at most ``nbytes`` (a segment needs the room): the least valuable chunks go first."""
        with self.lock:
            self._evict_until(lambda: self.stats.bytes <= nbytes, below=None)

    def drop(self, seg_id: str) -> None:
        """The segment left the tiers, or its whole copy is in the arena now."""
        with self.lock:
            self._drop_summaries(seg_id)
            for j in self.cached_chunks(seg_id):
                self._evict(seg_id, j)

    def cached_chunks(self, seg_id: str) -> set[int]:
        with self.lock:
            seg = self.segments.get(seg_id)
            return seg.chunks() if seg is not None else set()

    # --- internals (lock held) ---------------------------------------------------------------------
    def _make_room(self, nbytes: int, worth: float, exclude: tuple[str, int]) -> bool:
        """Room for ``nbytes`` more, evicting only chunks worth less than ``worth``."""
        if self.room() < nbytes:
            return False
        return self._evict_until(lambda: self.stats.bytes + nbytes <= self.room(), below=worth, exclude=exclude)

    def _evict_until(self, done: Callable[[], bool], below: float | None, exclude=None) -> bool:
        for seg_id in [s for s in self.summaries if s not in self.segments]:  # summaries of no cached chunk first
            if done():
                return True
            self._drop_summaries(seg_id)
        if done():
            return True
        units = []  # (value, seg_id, chunk)
        for seg_id, seg in self.segments.items():
            ids = sorted(seg.chunks())
            if ids:
                vals = self.value(seg_id, torch.tensor(ids)).tolist()
                units += [(v, seg_id, j) for v, j in zip(vals, ids) if (seg_id, j) != exclude]
        for v, seg_id, j in sorted(units, key=lambda u: u[0]):
            if below is not None and v >= below:
                return False
            self._evict(seg_id, j)
            if done():
                return True
        return done()

    def _evict(self, seg_id: str, j: int) -> None:
        seg = self.segments[seg_id]
        for layer in list(seg.layers):
            t = seg.layers[layer].pop(j, None)
            if t is not None:
                self.stats.bytes -= t.numel() * t.element_size()
            if not seg.layers[layer]:
                del seg.layers[layer]
        if not seg.layers:
            del self.segments[seg_id]
            self._drop_summaries(seg_id)

    def _drop_summaries(self, seg_id: str) -> None:
        hit = self.summaries.pop(seg_id, None)
        if hit is not None:
            self.stats.bytes -= hit[1].numel() * hit[1].element_size()
