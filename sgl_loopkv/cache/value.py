"""How valuable a stored segment is: what the host and disk tiers evict last.

``attention`` (default): ContiguousKV's score S_j = I_j x F_j per chunk, where I_j is the
accumulated attention importance of chunk j and F_j its access count; unlike the paper, both decay
with a half-life counted in accesses, so old popularity fades. Importance comes normalised by the
caller over the whole history a turn attended to (mean 1 per chunk), so a segment of a conversation
that the turn barely looked at scores below one it relied on; without a measurement it is 1. A
segment's value is the mean S_j of its chunks (a density: bytes are what eviction frees). While
eviction works on whole segments, a single-segment history's value reduces to its decayed access
count; the per-chunk scores rank the chunks the host chunk cache keeps
(:mod:`sgl_loopkv.cache.chunk_cache`).
``lru``: the time of the last access. Time is logical (one tick per access) so runs replay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sgl_loopkv.registry import Registry


class ValuePolicy(ABC):
    """Scores segments; the tiers evict the lowest score first."""

    @abstractmethod
    def on_access(self, seg_id: str, n_chunks: int, importance: torch.Tensor | None = None) -> None:
        """Segment ``seg_id`` (``n_chunks`` chunks) was stored or used by a request.
        ``importance``: [n_chunks] attention importance per chunk (mean 1 over the history the
        request attended to), or None for "no measurement" (counts as 1 per chunk)."""

    @abstractmethod
    def value(self, seg_id: str) -> float: ...

    @abstractmethod
    def forget(self, seg_id: str) -> None: ...

    def chunk_values(self, seg_id: str, chunks: torch.Tensor) -> torch.Tensor:
        """Value of each of a segment's ``chunks`` (the host chunk cache evicts the lowest first);
        by default the segment's own value for every chunk."""
        return torch.full((len(chunks),), self.value(seg_id))


VALUE_POLICIES: Registry[ValuePolicy] = Registry("value policy")


@dataclass(slots=True)
class _ChunkScores:
    importance: torch.Tensor  # [n_chunks] decayed I_j
    frequency: torch.Tensor  # [n_chunks] decayed F_j
    tick: int  # logical time of the last update


@VALUE_POLICIES.register("attention")
class AttentionValuePolicy(ValuePolicy):
    def __init__(self, half_life: float = 256.0):
        self.half_life = half_life
        self.now = 0
        self.scores: dict[str, _ChunkScores] = {}

    def _decayed(self, s: _ChunkScores) -> float:
        return 0.5 ** ((self.now - s.tick) / self.half_life)

    def on_access(self, seg_id, n_chunks, importance=None):
        self.now += 1
        a = torch.ones(n_chunks) if importance is None else importance.float()
        s = self.scores.get(seg_id)
        if s is None or len(s.importance) != n_chunks:
            self.scores[seg_id] = _ChunkScores(a.clone(), torch.ones(n_chunks), self.now)
            return
        d = self._decayed(s)
        s.importance = s.importance * d + a
        s.frequency = s.frequency * d + 1
        s.tick = self.now

    def value(self, seg_id):
        s = self.scores.get(seg_id)
        if s is None:
            return 0.0
        d = self._decayed(s)
        return float((s.importance * d * s.frequency * d).mean())

    def chunk_values(self, seg_id, chunks):
        s = self.scores.get(seg_id)  # read from the chunk reader's thread: one snapshot of the tensors
        if s is None:
            return torch.zeros(len(chunks))
        d = self._decayed(s)
        importance, frequency = s.importance, s.frequency
        return importance[chunks] * d * frequency[chunks] * d

    def forget(self, seg_id):
        self.scores.pop(seg_id, None)


@VALUE_POLICIES.register("lru")
class LRUValuePolicy(ValuePolicy):
    def __init__(self, **_):
        self.now = 0
        self.last: dict[str, int] = {}

    def on_access(self, seg_id, n_chunks, importance=None):
        self.now += 1
        self.last[seg_id] = self.now

    def value(self, seg_id):
        return float(self.last.get(seg_id, 0))

    def forget(self, seg_id):
        self.last.pop(seg_id, None)
