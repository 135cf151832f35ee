"""Chunk-pruned re-prefill (ContiguousKV): a returning history loaded only where the new turn looks.

When a history comes back from the tiers, :class:`PrunedRestore` gives it a device *page cache*
of ``budget x chunks`` chunks of pool slots and reads nothing up front (a disk hit is admitted
from its verified header and summaries). During the new turn's prefill, at the first layer of each
period of ``period`` layers, the loopkv attention backend hands the layer's query rows to
:meth:`PrunedRestore.select`: its :class:`~sgl_loopkv.cache.chunk_selection.ChunkSelection` scores
the chunks against their stored key summaries (no key is read, :mod:`sgl_loopkv.selection.chunks`),
keeps the best ones (the first chunk and the nearest ones always), each given a place in the cache
for this period, and the :class:`ChunkReader` thread copies them into their places for every layer
of the period (:mod:`sgl_loopkv.cache.chunk_loads`) - from the host tier, or from disk with each
extent's crc32 checked - while earlier layers compute. Then it reads the same set ahead for the
next period, in the same places, so that period reads only the chunks its own selection adds
(ContiguousKV's inter-period reuse); a place holds, at each layer, the chunk of that layer's
period. The layer's attention waits for its sub-period gate (:meth:`wait`) and reads the kept
chunks' places (:meth:`kept_slots`); a chunk whose extent failed its checksum is left out of that
layer's set and counted (:class:`PrunedStats`), never read.

The cache is the restore's, not the tree's: the history's tree nodes stay stored-only, the
request's row points its history positions at the pool's padding slot (never read: the plans list
the cache), and the cache is freed when the request ends. The turn itself is stored at its end like
any other (its KV computed over the kept chunks). Budget 1.0 keeps every chunk: the same KV as a
full load, read period by period.

Another way of choosing (the IMPRESS-style baseline of ``benchmarks/baselines/impress.py``) is a
:class:`~sgl_loopkv.cache.chunk_selection.ChunkSelection` registered by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sgl_loopkv.cache.chunk_loads import ChunkLoads
from sgl_loopkv.cache.chunk_reader import ChunkReader, Source
from sgl_loopkv.cache.chunk_selection import CHUNK_SELECTIONS, ChunkSelection
from sgl_loopkv.cache.prefix_config import PrefixConfig
from sgl_loopkv.cache.pruned_stats import PrunedStats
from sgl_loopkv.selection.chunks import keep_count

__all__ = ["ChunkReader", "KVBuffers", "PrunedHistory", "PrunedParams", "PrunedRestore", "PrunedStats", "Source"]


@dataclass(frozen=True, slots=True)
class PrunedParams:
    """How histories are pruned (from :class:`~sgl_loopkv.cache.prefix_config.PrefixConfig`): ``chunk`` tokens a
    chunk (the pool's page), ``budget`` the share of chunks kept, chosen every ``period`` layers by
    the ``selection`` registered under that name; a layer waits for its ``gate`` of layers' reads;
    the ``local`` nearest chunks are always kept; ``prefetch`` of a period's set is read ahead."""

    chunk: int
    budget: float
    period: int
    gate: int
    local: int
    prefetch: float = 0.0
    selection: str = "chunks"

    @classmethod
    def from_config(cls, cfg: PrefixConfig, chunk: int) -> PrunedParams:
        return cls(chunk, cfg.budget, cfg.period, cfg.gate, cfg.local, cfg.prefetch, cfg.selection)


@dataclass(slots=True)
class PrunedHistory:
    """A request's stored history: ``n_chunks`` chunks from ``sources`` at the positions ``start ..``
    of its row; ``summaries`` [periods, n_chunks, H, 2, D] their key summaries at each period's first
    layer (none when nothing is scored)."""

    rid: str
    sources: list[Source]
    n_chunks: int
    start: int
    summaries: torch.Tensor


class KVBuffers(NamedTuple):
    """The KV pool's layers the page cache lives in: ``k[layer]``, ``v[layer]`` [slots, H, D]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


class PrunedRestore:
    """A history of ``n_chunks`` chunks restored for one request into ``slots`` [n_chunks * chunk]
    (the history's positions ``start ..``), loaded period by period as :meth:`select` decides."""

    def __init__(self, history: PrunedHistory, pool: KVBuffers, reader: ChunkReader, params: PrunedParams, disk=None):
        self.rid, self.sources, self.start = history.rid, history.sources, history.start
        self.summaries = history.summaries  # [periods, m, H, 2, D]: each period's first layer (none at budget 1.0)
        self.params = params
        self.chunk, self.budget, self.period = params.chunk, params.budget, params.period
        self.gate, self.local, self.prefetch = params.gate, params.local, params.prefetch
        self.num_layers = len(pool.k)
        self.n_chunks = history.n_chunks
        self.tokens = self.n_chunks * self.chunk
        self.keep = keep_count(self.n_chunks, self.budget)
        self.stats = PrunedStats()
        self.loads = ChunkLoads(
            history.sources, self.n_chunks, pool.k, pool.v, reader, disk, self.chunk, self.gate, self.stats
        )
        self.selection: ChunkSelection = CHUNK_SELECTIONS.create(params.selection)
        self.capacity = self.selection.capacity(self.n_chunks, self.budget)
        n_periods = -(-self.num_layers // self.period)
        self.kept: list[torch.Tensor | None] = [None] * n_periods  # latest selection of each period
        # per period, chunk -> its chunk place in the page cache (-1: none); a place holds, at each
        # layer, the chunk its period maps there, so every period uses the same keep-chunk cache
        self.where = torch.full((n_periods, self.n_chunks), -1, dtype=torch.int64)
        self.mass = torch.zeros(self.n_chunks)  # the selections' estimated attention mass per chunk, summed
        self._kept_cache: dict[int, tuple[int, torch.Tensor]] = {}
        self.closed = False
        self.last_used = time.monotonic()
        self.selection.bind(self)

    @staticmethod
    def capacity_for(n_chunks: int, budget: float, selection: str) -> int:
        """Chunk places of the page cache under the named selection (the budget's for ``chunks``).
        The cache allocates this before the restore exists."""
        return CHUNK_SELECTIONS.create(selection).capacity(n_chunks, budget)

    @property
    def cache_tokens(self) -> int:
        """Device-pool slots the restore holds: its page cache, whatever the history's length."""
        return self.capacity * self.chunk

    def attach(self, slots: torch.Tensor) -> None:
        """The page cache's pool slots (``cache_tokens`` of them)."""
        assert len(slots) == self.cache_tokens, (len(slots), self.cache_tokens)
        self.loads.attach(slots)
        self.stats.cache_tokens = len(slots)

    # the loading side's state, as the cache and the tests read it
    slots = property(lambda self: self.loads.slots)
    paged = property(lambda self: self.loads.paged)
    loaded = property(lambda self: self.loads.loaded)
    asked = property(lambda self: self.loads.asked)
    bad = property(lambda self: self.loads.bad)
    prefetched = property(lambda self: self.loads.prefetched)
    bad_segments = property(lambda self: self.loads.bad_segments)
    layer_bytes = property(lambda self: self.loads.layer_bytes)  # a chunk of a layer, K and V
    k_buffers = property(lambda self: self.loads.k_buffers)
    v_buffers = property(lambda self: self.loads.v_buffers)

    # --- the forward's side ----------------------------------------------------------------------
    def period_of(self, layer: int) -> int:
        return layer // self.period

    def layers_of(self, p: int) -> range:
        return range(p * self.period, min((p + 1) * self.period, self.num_layers))

    def needs_selection(self, layer: int) -> bool:
        return layer % self.period == 0 or self.kept[self.period_of(layer)] is None

    def select(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """At a period's first layer: choose its chunks from this layer's query rows q [n, Hq, D],
        queue their reads for every layer of the period (and, ContiguousKV, for the next period)."""
        return self.selection.select(layer, q, scale)

    def decode_select(self, layer: int, q: torch.Tensor, scale: float, tau: float, serial: bool = False) -> None:
        """At a period's first layer of a decode step: the selection may choose the period's chunks
        anew when the query drifted (cosine < ``tau``), recalled from the tiers behind the next
        periods' compute (``serial``: recalled now and waited for)."""
        self.loads.in_prefill = False
        self.selection.decode_select(layer, q, scale, tau, serial)

    def _flush_recalls(self, skip: int | None) -> None:
        self.selection.flush_recalls(skip)

    # --- what selections call --------------------------------------------------------------------
    def keep_period(self, p: int, chunks: torch.Tensor) -> None:
        """Period ``p`` keeps ``chunks``: places in the page cache for them. A chunk placed there
        already (read ahead) keeps its place, the others take the places of the chunks dropped. A
        dropped chunk's reads for this period are forgotten."""
        self.kept[p] = chunks
        where = self.where[p]
        chosen = torch.zeros(self.n_chunks, dtype=torch.bool)
        chosen[chunks] = True
        dropped = (where >= 0) & ~chosen
        if dropped.any():
            self.loads.forget(self.layers_of(p), dropped)
            where[dropped] = -1
        used = torch.zeros(self.capacity, dtype=torch.bool)
        used[where[where >= 0]] = True
        free = torch.nonzero(~used).flatten()
        new = chunks[where[chunks] < 0]
        where[new] = free[: len(new)]

    def selected(self, p: int, chunks: torch.Tensor) -> None:
        """A prefill selection of period ``p`` made: its layers' kept slots change; counted."""
        self._bump(self.layers_of(p))
        self.stats.selections += 1
        self.stats.kept_chunks += len(chunks)
        self.stats.scored_chunks += self.n_chunks

    def recall(self, p: int, chunks: torch.Tensor) -> None:
        """A decode selection's ``chunks`` become period ``p``'s: read what the page cache lacks."""
        self.keep_period(p, chunks)
        self._bump(self.layers_of(p))
        before = int(self.asked[self.layers_of(p)].sum())
        self.queue_reads(self.layers_of(p), chunks, prefetch=False)
        self.stats.recalled_bytes += (int(self.asked[self.layers_of(p)].sum()) - before) * self.layer_bytes

    def queue_reads(self, layers: range, chunks: torch.Tensor, prefetch: bool) -> None:
        """Queue the reads of ``chunks`` for ``layers`` (one period's) into that period's places."""
        if not len(layers):
            return
        self.loads.queue(layers, chunks, self.where[self.period_of(layers.start)], prefetch)

    def _bump(self, layers) -> None:
        for layer in layers:
            self.loads.version[layer] += 1

    def wait(self, layer: int) -> None:
        """Before layer ``layer`` reads the pool: its reads, and those of the rest of its gate (the
        next ``gate`` layers, within the period), are done."""
        p_end = min((self.period_of(layer) + 1) * self.period, self.num_layers)
        last = min(layer - layer % self.gate + self.gate, p_end) - 1
        self.loads.wait_for(range(layer, max(last, layer) + 1))

    def kept_chunks(self, layer: int) -> torch.Tensor:
        """History chunks layer ``layer`` attends to: its period's kept chunks that loaded well."""
        chunks = self.kept[self.period_of(layer)]
        if chunks is None:  # nothing selected for this period yet (cannot happen after a prefill)
            return torch.zeros(0, dtype=torch.int64)
        return chunks[self.loaded[layer, chunks] & ~self.bad[layer, chunks]]

    def kept_positions(self, layer: int) -> torch.Tensor:
        """History offsets (0 .. tokens) attention reads at this layer: the tokens of
        :meth:`kept_chunks` (those of them the selection's token mask keeps)."""
        chunks = self.kept_chunks(layer)
        pos = (chunks[:, None] * self.chunk + torch.arange(self.chunk)).flatten()
        mask = self.selection.token_mask(self.period_of(layer))
        return pos if mask is None else pos[mask[pos]]

    def kept_slots(self, layer: int) -> torch.Tensor:
        """The page-cache slots holding :meth:`kept_positions` at this layer, in position order;
        cached until a selection or a read changes them (every decode step asks for every layer)."""
        hit = self._kept_cache.get(layer)
        version = self.loads.version[layer]
        if hit is not None and hit[0] == version:
            return hit[1]
        p, chunks = self.period_of(layer), self.kept_chunks(layer)
        slots = self.loads.slots_of(self.where[p], chunks)
        mask = self.selection.token_mask(p)
        if mask is not None:
            slots = slots[mask.view(-1, self.chunk)[chunks].flatten()]
        self._kept_cache[layer] = (version, slots)
        return slots

    # --- the end ---------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every queued read (before the slots are freed or the files closed)."""
        self.loads.settle()

    def account(self) -> PrunedStats:
        """Used and wasted bytes as of the latest selections (call once the turn's prefill is over)."""
        used = 0  # tokens
        for layer in range(self.num_layers):
            p = self.period_of(layer)
            if self.kept[p] is None:
                continue
            sel = torch.zeros(self.n_chunks, dtype=torch.bool)
            sel[self.kept[p]] = True
            ok = (self.loaded[layer] & ~self.bad[layer] & sel).repeat_interleave(self.chunk)
            mask = self.selection.token_mask(p)
            if mask is not None:
                ok &= mask
            used += int(ok.sum())
        self.stats.bytes_used = used * self.layer_bytes // self.chunk
        self.stats.prefetched_bytes = self.loads.n_prefetched * self.layer_bytes
        self.stats.wasted_prefetch_bytes = self.loads.n_wasted * self.layer_bytes
        return self.stats

    def chunk_importance(self) -> torch.Tensor | None:
        """Per history chunk, the attention mass the selections estimated (mean 1), for the tiers'
        value policy; None when nothing was scored (budget 1.0)."""
        total = float(self.mass.sum())
        return self.mass * (self.n_chunks / total) if total > 0 else None

    def close(self) -> None:
        """The request is done with it: reads finished, files closed."""
        if self.closed:
            return
        self.loads.close()
        self.closed = True

    def offer_reads(self) -> None:
        """After :meth:`close`: offer what the prefill read from disk to the host chunk cache (the
        scheduler calls this once the batch's outputs are streamed)."""
        self.loads.offer_reads()
