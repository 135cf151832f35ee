"""Chunk-pruned re-prefill (ContiguousKV): a returning history loaded only where the new turn looks.

When a history comes back from the tiers, :class:`PrunedRestore` gives it a device *page cache*
of ``budget x chunks`` chunks of pool slots and reads nothing up front (a disk hit is admitted
from its verified header and summaries). During the new turn's prefill, at the first layer of each
period of ``period`` layers, the loopkv attention backend hands the layer's query rows to
:meth:`PrunedRestore.select`: the chunks are scored against their stored key summaries (no key is
read, :mod:`sgl_loopkv.selection.chunks`), the best ones kept (the first chunk and the nearest ones
always), each given a place in the cache for this period, and the :class:`ChunkReader` thread
copies them into their places for every layer of the period - from the host tier, or from disk
with each extent's crc32 checked - while earlier layers compute. Then it reads the same set ahead
for the next period, in the same places, so that period reads only the chunks its own selection
adds (ContiguousKV's inter-period reuse); a place holds, at each layer, the chunk of that layer's
period. The layer's attention waits for its sub-period gate (:meth:`wait`) and reads the kept
chunks' places (:meth:`kept_slots`); a chunk whose extent failed its checksum is left out of that
layer's set and counted, never read.

The cache is the restore's, not the tree's: the history's tree nodes stay stored-only, the
request's row points its history positions at the pool's padding slot (never read: the plans list
the cache), and the cache is freed when the request ends. The turn itself is stored at its end like
any other (its KV computed over the kept chunks). Budget 1.0 keeps every chunk: the same KV as a
full load, read period by period.

``selection="impress"`` is the baseline ContiguousKV compares with (IMPRESS): at a period's first
layer the full keys of that layer's whole history are read (the probe, synchronous: the forward
waits for it), the tokens are chosen by exact attention mass, and every 64-token block holding a
chosen token is read for the period's other layers; attention reads the chosen tokens only. Its
page cache holds the whole history (a chunk's place is its index), its probe and block padding are
read but not used (its read amplification), and nothing is read ahead.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from sgl_loopkv.cache.chunk_cache import HostChunkCache
from sgl_loopkv.cache.copy_stream import CopyStream
from sgl_loopkv.kernels import chunk_io
from sgl_loopkv.platform import keep_torch_on_this_thread
from sgl_loopkv.selection.chunks import (
    always_kept,
    chunk_scores,
    keep_count,
    select_chunks,
    select_tokens,
    token_scores,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Source:
    """One stored node's part of the history: chunks ``[lo, hi)`` of segment ``seg_id`` are the
    history's chunks ``[first, first + hi - lo)``. Its KV comes from ``host_kv`` (the host tier's
    copy of exactly those chunks, ``host_kv[layer]`` -> [2, T, H, D]) or from the open segment file
    ``fd`` (``header`` verified), read a few chunks at a time; a disk source's chunks that the host
    chunk ``cache`` holds come from there, and what is read from disk is offered to it."""

    seg_id: str
    lo: int
    hi: int
    first: int
    host_kv: object | None = None
    fd: int | None = None
    header: dict | None = None
    cache: HostChunkCache | None = None

    @property
    def n_chunks(self) -> int:
        return self.hi - self.lo


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

    @property
    def inter_period_overlap(self) -> float:
        return self.overlap_sum / self.overlaps if self.overlaps else 0.0

    @property
    def read_amplification(self) -> float:
        return self.disk_bytes_read / self.bytes_used if self.bytes_used else 0.0

    def add(self, other: PrunedStats) -> None:
        for f in self.__slots__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


class PrunedRestore:
    """A history of ``n_chunks`` chunks restored for one request into ``slots`` [n_chunks * chunk]
    (the history's positions ``start ..``), loaded period by period as :meth:`select` decides."""

    def __init__(
        self,
        rid: str,
        sources: list[Source],
        n_chunks: int,
        start: int,
        summaries: torch.Tensor,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        reader: ChunkReader,
        *,
        chunk: int,
        budget: float,
        period: int,
        gate: int,
        local: int,
        prefetch: float = 0.0,
        disk=None,
        selection: str = "chunks",
        block: int = 64,
    ):
        if selection not in ("chunks", "impress"):
            raise ValueError(f"unknown chunk selection {selection!r}")
        self.rid, self.sources, self.start = rid, sources, start
        self.summaries = summaries  # [periods, m, H, 2, D]: each period's first layer (none at budget 1.0)
        self.k_buffers, self.v_buffers, self.reader, self.disk = k_buffers, v_buffers, reader, disk
        self.copies = reader.copies(k_buffers[0].device)  # on a GPU the reader's copies run on its stream
        self.chunk, self.budget, self.period, self.gate, self.local = chunk, budget, period, gate, local
        self.prefetch = prefetch  # share of a period's set read ahead for the next period
        self.num_layers = len(k_buffers)
        self.n_chunks = n_chunks
        self.tokens = n_chunks * chunk
        self.keep = keep_count(self.n_chunks, budget)
        self.impress, self.block = selection == "impress", block
        self.capacity = self.capacity_for(n_chunks, budget, selection)
        self.slots: torch.Tensor | None = None  # the device page cache: keep chunks of slots (see attach)
        self.paged = False  # its places are aligned pool pages (see attach)
        n_periods = -(-self.num_layers // period)
        self.kept: list[torch.Tensor | None] = [None] * n_periods  # latest selection of each period
        # per period, chunk -> its chunk place in the page cache (-1: none); a place holds, at each
        # layer, the chunk its period maps there, so every period uses the same keep-chunk cache
        self.where = torch.full((n_periods, self.n_chunks), -1, dtype=torch.int64)
        if self.impress:  # the cache spans the history: a chunk's place is its index, in every period
            self.where[:] = torch.arange(self.n_chunks)
        # impress: per period, the history tokens attention reads (None: every token of the kept chunks)
        self.kept_tokens: list[torch.Tensor | None] = [None] * n_periods
        self.n_prefetched = 0  # (layer, chunk) reads queued ahead for the next period
        self.n_wasted = 0  # of those, dropped by that period's own selection
        self.loaded = torch.zeros(self.num_layers, self.n_chunks, dtype=torch.bool)  # in the pool (reader thread)
        self.asked = torch.zeros(self.num_layers, self.n_chunks, dtype=torch.bool)  # queued or loaded
        self.bad = torch.zeros(self.num_layers, self.n_chunks, dtype=torch.bool)
        self.prefetched = torch.zeros(self.num_layers, self.n_chunks, dtype=torch.bool)
        self._pending = [0] * self.num_layers
        self._copied: list = [None] * self.num_layers  # CUDA: layer's latest copy event (reader.copies' stream)
        self._cond = threading.Condition()
        self._idle_since: float | None = None  # every queued read done (compute wait runs from here)
        self._in_prefill = True  # decode-time recalls are not waiting for a selection
        self.stats = PrunedStats()
        self.mass = torch.zeros(self.n_chunks)  # the selections' estimated attention mass per chunk, summed
        self.bad_segments: set[str] = set()  # segments with an extent that failed its checksum
        self._offers: list = []  # disk reads for the host chunk cache: (source, layers, chunks, rows per layer)
        self._decode_q: dict[int, torch.Tensor] = {}  # period -> the decode query it last chose with
        self._recalls: dict[int, torch.Tensor] = {}  # period -> chunks chosen, recalled at the next period
        # per layer, bumped by its period's selections and its own reads: kept_slots' cache key (a
        # read of a later layer must not make every layer rebuild its slot list)
        self._version = [0] * self.num_layers
        self._kept_cache: dict[int, tuple[int, torch.Tensor]] = {}
        self.closed = False
        self.last_used = time.monotonic()
        k0 = k_buffers[0]
        self.layer_bytes = 2 * chunk * k0.shape[1] * k0.shape[2] * k0.element_size()  # a chunk of a layer, K and V

    @staticmethod
    def capacity_for(n_chunks: int, budget: float, selection: str) -> int:
        """Chunk places of the page cache: the budget's, or the whole history for the IMPRESS-style
        baseline (its blocks can lie anywhere). The cache allocates this before the restore exists."""
        return n_chunks if selection == "impress" else keep_count(n_chunks, budget)

    @property
    def cache_tokens(self) -> int:
        """Device-pool slots the restore holds: its page cache, whatever the history's length."""
        return self.capacity * self.chunk

    def attach(self, slots: torch.Tensor) -> None:
        """The page cache's pool slots (``cache_tokens`` of them)."""
        assert len(slots) == self.cache_tokens, (len(slots), self.cache_tokens)
        self.slots = slots
        rows, c = slots.view(-1, self.chunk).cpu(), self.chunk
        # each place one aligned pool page (the paged allocator's): reads are copied in page by page
        self.paged = self.k_buffers[0].shape[0] % c == 0 and bool(
            ((rows[:, :1] % c == 0) & (rows == rows[:, :1] + torch.arange(c))).all()
        )
        self.stats.cache_tokens = len(slots)

    # --- the forward's side ----------------------------------------------------------------------
    def period_of(self, layer: int) -> int:
        return layer // self.period

    def select(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """At a period's first layer: choose its chunks from this layer's query rows q [n, Hq, D],
        queue their reads for every layer of the period, then prefetch them for the next period."""
        p = self.period_of(layer)
        if self.impress and self.keep < self.n_chunks:
            return self._select_tokens(layer, q, scale)
        if self.keep >= self.n_chunks:
            chunks = ahead = torch.arange(self.n_chunks)  # every period keeps them all: nothing is wasted
        else:
            scores = chunk_scores(q.to(self.summaries.device), self.summaries[p], scale, self.chunk)
            chunks = select_chunks(scores, self.keep, self.local)
            ahead = self._surest(chunks, scores)
            self.mass += scores
        prev = self.kept[p - 1] if p else None
        if prev is not None and len(chunks):  # what the prefetch of the previous period's set covered
            self.stats.overlap_sum += float(torch.isin(chunks, prev).float().mean())
            self.stats.overlaps += 1
        self.kept[p] = chunks
        self._assign(p, chunks)
        self._selected(p, chunks)
        first, end = p * self.period, min((p + 1) * self.period, self.num_layers)
        self._queue(range(first, end), chunks, prefetch=False)
        if end < self.num_layers and self.kept[p + 1] is None:  # ContiguousKV: the next period probably
            self.where[p + 1] = self.where[p]  # wants much the same chunks: the same places, read ahead
            self._queue(range(end, min(end + self.period, self.num_layers)), ahead, prefetch=True)
        return chunks

    def _select_tokens(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """IMPRESS-style selection at a period's first layer: probe (read this layer's whole
        history and wait for it), choose tokens by exact mass, read their blocks for the period's
        other layers."""
        p = self.period_of(layer)
        every = torch.arange(self.n_chunks)
        self._queue(range(layer, layer + 1), every, prefetch=False)
        self._wait_for(range(layer, layer + 1))
        valid = (self.loaded[layer] & ~self.bad[layer]).repeat_interleave(self.chunk)
        keys = self.k_buffers[layer][self._slots_of(p, every).to(self.k_buffers[layer].device)]
        scores = token_scores(q.to(keys.device), keys, scale, valid)
        mask, chunks = select_tokens(
            scores, math.ceil(self.budget * self.tokens - 1e-9), self.chunk, self.local, self.block
        )
        self.mass += scores.view(self.n_chunks, self.chunk).sum(dim=1)
        self.kept[p], self.kept_tokens[p] = chunks, mask
        self._selected(p, chunks)
        self._queue(range(layer + 1, min((p + 1) * self.period, self.num_layers)), chunks, prefetch=False)
        return chunks

    def _selected(self, p: int, chunks: torch.Tensor) -> None:
        self._bump(self._layers(p))
        self.stats.selections += 1
        self.stats.kept_chunks += len(chunks)
        self.stats.scored_chunks += self.n_chunks

    def _surest(self, chunks: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The part of a period's set read ahead for the next period: the always-kept chunks (first,
        nearest: certain to be kept again), then the best scored, ``prefetch`` of the set in all,
        and never fewer than two sets of ``keep`` out of ``n_chunks`` must share (2 keep - n_chunks:
        at budget 0.9 eight in nine of the set, at 0.5 and below none). Consecutive periods of
        SmolLM2 share about half their chunks at budget 0.1, and the best scored are only slightly
        likelier to stay (benchmarks/results/studies/prefetch_survival.md); at 0.75-0.9 reading nothing
        ahead left each period's reads waiting."""
        forced = always_kept(self.n_chunks, self.keep, self.local)[chunks]
        n = max(int(forced.sum()), round(self.prefetch * len(chunks)), 2 * self.keep - self.n_chunks)
        order = torch.argsort(scores[chunks].masked_fill(forced, torch.inf), descending=True, stable=True)
        return chunks[order[:n]].sort().values

    def _bump(self, layers) -> None:
        for layer in layers:
            self._version[layer] += 1

    def _layers(self, p: int) -> range:
        return range(p * self.period, min((p + 1) * self.period, self.num_layers))

    def _assign(self, p: int, chunks: torch.Tensor) -> None:
        """Places in the page cache for period ``p``'s chunks: a chunk placed there already (read
        ahead) keeps its place, the others take the places of the chunks dropped. A dropped chunk's
        reads for this period are forgotten (a read still queued for it lands before the read of the
        chunk that takes its place: one reader, in order)."""
        where = self.where[p]
        chosen = torch.zeros(self.n_chunks, dtype=torch.bool)
        chosen[chunks] = True
        dropped = (where >= 0) & ~chosen
        if dropped.any():
            for layer in self._layers(p):
                self.n_wasted += int((self.prefetched[layer] & dropped).sum())
                for mask in (self.asked, self.loaded, self.prefetched, self.bad):
                    mask[layer, dropped] = False
            where[dropped] = -1
        used = torch.zeros(self.capacity, dtype=torch.bool)
        used[where[where >= 0]] = True
        free = torch.nonzero(~used).flatten()
        new = chunks[where[chunks] < 0]
        where[new] = free[: len(new)]

    # --- decode: FreeKV-style re-selection with recall from the tiers -----------------------------
    def decode_select(self, layer: int, q: torch.Tensor, scale: float, tau: float, serial: bool = False) -> None:
        """At a period's first layer of a decode step. Reads decided at earlier periods are queued
        first (their layers of this step are done, so their places can be rewritten). Then, when the
        query drifted from the one this period last chose with (cosine < ``tau``), the period's chunks
        are chosen anew with it - used from the next step on (FreeKV's speculation: this step attends
        to the previous choice while the new chunks are recalled from the host or disk tier into the
        places of the dropped ones). ``serial``: recall now and wait (the reference the overlapped
        path must equal)."""
        p = self.period_of(layer)
        self._in_prefill = False
        if self.impress:  # the baseline decodes over its last selection
            return
        self._flush_recalls(skip=p)
        qv = q.float().flatten()
        last = self._decode_q.get(p)
        if last is not None and float(torch.nn.functional.cosine_similarity(qv, last, dim=0)) >= tau:
            return
        self._decode_q[p] = qv
        if self.keep >= self.n_chunks or self.kept[p] is None:
            return
        scores = chunk_scores(q.to(self.summaries.device), self.summaries[p], scale, self.chunk)
        chunks = select_chunks(scores, self.keep, self.local)
        self.stats.decode_selections += 1
        if torch.equal(chunks, self.kept[p]):
            return
        self._recalls[p] = chunks
        if serial:
            self._flush_recalls(skip=None)
            for x in self._layers(p):
                self.wait(x)

    def _flush_recalls(self, skip: int | None) -> None:
        for p in [x for x in self._recalls if x != skip]:
            chunks = self._recalls.pop(p)
            self.kept[p] = chunks
            self._assign(p, chunks)
            self._bump(self._layers(p))
            before = int(self.asked[self._layers(p)].sum())
            self._queue(self._layers(p), chunks, prefetch=False)
            self.stats.recalled_bytes += (int(self.asked[self._layers(p)].sum()) - before) * self.layer_bytes

    def needs_selection(self, layer: int) -> bool:
        return layer % self.period == 0 or self.kept[self.period_of(layer)] is None

    def wait(self, layer: int) -> None:
        """Before layer ``layer`` reads the pool: its reads, and those of the rest of its gate (the
        next ``gate`` layers, within the period), are done."""
        p_end = min((self.period_of(layer) + 1) * self.period, self.num_layers)
        last = min(layer - layer % self.gate + self.gate, p_end) - 1
        self._wait_for(range(layer, max(last, layer) + 1))

    def _wait_for(self, layers: range, count: bool = True) -> None:
        """Until every read queued for ``layers`` is done (``count``: as I/O wait)."""
        if any(self._pending[x] for x in layers):
            t0 = time.perf_counter()
            with self._cond:
                while any(self._pending[x] for x in layers):
                    self._cond.wait()
            if count:
                self.stats.io_wait_s += time.perf_counter() - t0
        if self.copies.stream is not None:
            with self._cond:  # one stream, reads in order: a layer's latest event covers the earlier ones
                events = [self._copied[x] for x in layers]
                for x in layers:
                    self._copied[x] = None
            for event in events:
                CopyStream.wait(event)

    def kept_chunks(self, layer: int) -> torch.Tensor:
        """History chunks layer ``layer`` attends to: its period's kept chunks that loaded well."""
        chunks = self.kept[self.period_of(layer)]
        if chunks is None:  # nothing selected for this period yet (cannot happen after a prefill)
            return torch.zeros(0, dtype=torch.int64)
        return chunks[self.loaded[layer, chunks] & ~self.bad[layer, chunks]]

    def kept_positions(self, layer: int) -> torch.Tensor:
        """History offsets (0 .. tokens) attention reads at this layer: the tokens of
        :meth:`kept_chunks` (impress: those of them chosen)."""
        chunks = self.kept_chunks(layer)
        pos = (chunks[:, None] * self.chunk + torch.arange(self.chunk)).flatten()
        mask = self.kept_tokens[self.period_of(layer)]
        return pos if mask is None else pos[mask[pos]]

    def kept_slots(self, layer: int) -> torch.Tensor:
        """The page-cache slots holding :meth:`kept_positions` at this layer, in position order;
        cached until a selection or a read changes them (every decode step asks for every layer)."""
        hit = self._kept_cache.get(layer)
        if hit is not None and hit[0] == self._version[layer]:
            return hit[1]
        version = self._version[layer]
        p, chunks = self.period_of(layer), self.kept_chunks(layer)
        slots = self._slots_of(p, chunks)
        mask = self.kept_tokens[p]
        if mask is not None:
            slots = slots[mask.view(-1, self.chunk)[chunks].flatten()]
        self._kept_cache[layer] = (version, slots)
        return slots

    def _slots_of(self, p: int, chunks: torch.Tensor) -> torch.Tensor:
        return self.slots.view(-1, self.chunk)[self.where[p, chunks]].flatten()

    # --- reads -----------------------------------------------------------------------------------
    def _queue(self, layers: range, chunks: torch.Tensor, prefetch: bool) -> None:
        """Queue the reads of ``chunks`` not yet asked for, for ``layers`` (one period's): one job for
        each run of layers of one gate that miss the same chunks (a disk job reads them for all its
        layers at once, so a job spans no more than what a layer's compute waits for anyway)."""
        todo = [chunks[~self.asked[layer, chunks]] for layer in layers]
        jobs, i = [], 0
        while i < len(todo):
            j = i + 1
            while j < len(todo) and layers[j] % self.gate and torch.equal(todo[j], todo[i]):
                j += 1
            if len(todo[i]):
                jobs.append((range(layers[i], layers[i] + j - i), todo[i]))
            i = j
        if jobs and any(src.fd is not None for src in self.sources):
            self.reader.advise(self, jobs)  # the reader hints them all before it reads the first
        for job_layers, job_chunks in jobs:
            self._submit(job_layers, job_chunks, prefetch)

    def _submit(self, layers: range, todo: torch.Tensor, prefetch: bool) -> None:
        self.asked[layers.start : layers.stop, todo] = True
        self.prefetched[layers.start : layers.stop, todo] = prefetch
        self.n_prefetched += len(todo) * len(layers) if prefetch else 0
        with self._cond:
            if self._idle_since is not None and self._in_prefill and not any(self._pending):
                self.stats.compute_wait_s += time.perf_counter() - self._idle_since
            self._idle_since = None
            for layer in layers:
                self._pending[layer] += 1
        slots = self._slots_of(self.period_of(layers.start), todo)
        self.reader.submit(self, layers, todo, slots, self.copies.submitted())

    def load(self, layers: range, chunks: torch.Tensor, dst: torch.Tensor, after=None) -> None:
        """Reader thread: copy ``chunks`` of ``layers`` into the slots ``dst`` (``chunk`` per chunk, in
        order), disk extents verified first (one read per run of chunks for all the layers); each
        layer is released to the forward as soon as it is copied (on a GPU: its copies queued on the
        reader's stream, after ``after``, the forward's work when the read was submitted)."""
        t0 = time.perf_counter()
        released = 0
        try:  # tensor ops, no Python loop per chunk: this thread shares the GIL with the forward
            c = self.chunk
            parts = []  # per source: (its chunks' places in ``chunks``, history ids, per layer (kv, bad) or None)
            offers = []  # disk reads for the host chunk cache (kept for :meth:`offer_reads`)
            for src in self.sources:
                at = torch.nonzero((chunks >= src.first) & (chunks < src.first + src.n_chunks)).flatten()
                if len(at) == 0:
                    continue
                mine = chunks[at]  # history chunk ids, ascending
                if src.host_kv is not None:
                    parts.append((src, at, mine, None))
                    continue
                if src.cache is not None:
                    hit, rows = src.cache.take(src.seg_id, layers, (mine - src.first + src.lo).tolist())
                    if hit:
                        cached = torch.isin(mine, torch.tensor(hit) - src.lo + src.first)
                        parts.append((src, at[cached], mine[cached], [(r, []) for r in rows]))
                        self.stats.cached_bytes += int(cached.sum()) * len(layers) * self.layer_bytes
                        at, mine = at[~cached], mine[~cached]
                        if len(mine) == 0:
                            continue
                local = (mine - src.first + src.lo).tolist()
                before = self.disk.codec.bytes_read
                pages = dst.view(-1, c)[at, 0] // c if self.paged else None
                bads = None
                if pages is not None:  # straight into the pool pages, without the GIL (None: cannot here)
                    k_rows = [self.k_buffers[x] for x in layers]
                    v_rows = [self.v_buffers[x] for x in layers]
                    bads = self.disk.read_chunks_into(src.fd, src.header, layers, local, k_rows, v_rows, pages)
                if bads is not None:
                    read = [(None, b) for b in bads]  # in place already
                    if src.cache is not None and not any(bads):
                        offers.append((src, local, [(self._pages_kv(x, pages), []) for x in layers]))
                else:
                    kvs, bads = self.disk.read_chunks(src.fd, src.seg_id, src.header, layers, local)
                    read = [(kvs[i], bads[i]) for i in range(len(layers))]
                    if src.cache is not None and not any(bads):
                        offers.append((src, local, read))
                self.stats.disk_bytes_read += self.disk.codec.bytes_read - before
                parts.append((src, at, mine, read))
            with self.copies.copying(after):
                for i, layer in enumerate(layers):
                    for src, at, mine, read in parts:
                        if read is not None:
                            kv, bad = read[i]
                        else:  # a packed row decodes at each lookup: once here
                            kv, bad = src.host_kv[layer], []
                            if self._copy_host(kv, layer, mine - src.first, dst.view(-1, c)[at]):
                                kv = None  # in place already
                            else:
                                kv = self._host_chunks(kv, mine - src.first)
                        if kv is not None:
                            kv = kv.reshape(2, len(mine), c, *kv.shape[-2:])  # per chunk (a view: no copy)
                        if bad:
                            kv, at, mine = self._drop_bad(src, layer, kv, at, mine, bad)
                            if len(mine) == 0:
                                continue
                        if kv is not None:
                            self._put(layer, kv, dst.view(-1, c)[at])
                        self.loaded[layer, mine] = True
                        self.stats.bytes_loaded += len(mine) * self.layer_bytes
                    self._release(layer, self.copies.copied())
                    released += 1
            # offered once the request's output is out (:meth:`offer_reads`), not here: this thread's
            # Python work would hold the GIL against the forward; a decode-time recall's reads are not
            # offered (held until then, a long decode's would add up)
            if self._in_prefill:
                self._offers += [(src, layers, local, [kv for kv, _ in read]) for src, local, read in offers]
        except Exception:  # never leave the forward waiting; what did not load is not attended
            logger.exception("loopkv: reading chunks of layers %d-%d failed", layers.start, layers.stop - 1)
        finally:
            self.stats.reader_busy_s += time.perf_counter() - t0
            for layer in layers[released:]:
                self._release(layer)

    def advise(self, jobs: list[tuple[range, torch.Tensor]]) -> None:
        """Reader thread, before the first of ``jobs`` (one :meth:`_queue`'s: a period's set, or its
        read-ahead): hint every disk read they will make to the kernel, so that those cold reads
        are in flight together while the first job's are verified and copied (chunks the host chunk
        cache holds are left out). A hint only: whatever fails here, the reads still run."""
        t0 = time.perf_counter()
        try:
            for src in self.sources:
                if src.fd is None:
                    continue
                cached = src.cache.cached_chunks(src.seg_id) if src.cache is not None else ()
                for layers, chunks in jobs:
                    mine = chunks[(chunks >= src.first) & (chunks < src.first + src.n_chunks)]
                    local = [j for j in (mine - src.first + src.lo).tolist() if j not in cached]
                    if local:
                        self.disk.advise(src.fd, src.header, layers, local)
        except Exception:
            logger.debug("loopkv: read hints failed", exc_info=True)
        finally:
            self.stats.reader_busy_s += time.perf_counter() - t0

    def _host_chunks(self, kv: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Chunks ``local`` (ascending) of a source's host KV ``kv`` at one layer: [2, n * c, H, D]."""
        c = self.chunk
        lo, hi = int(local[0]), int(local[-1])
        if hi - lo == len(local) - 1:  # one run (budget 1.0: all of them): a view
            return kv[:, lo * c : (hi + 1) * c]
        # whole chunks, not token rows: half the time of a gather by token index
        return kv.unflatten(1, (-1, c)).index_select(1, local).flatten(1, 2)

    def _copy_host(self, x: torch.Tensor, layer: int, local: torch.Tensor, to: torch.Tensor) -> bool:
        """Copy chunks ``local`` (ascending) of a source's host KV ``x`` [2, T, H, D] at ``layer``
        straight into their pool pages ``to`` [n, c], natively: one memcpy per chunk's K or V rows, no
        gathered temporary, no GIL (gathering then copying took twice as long, on the cores the
        forward runs on). False when they cannot go that way (no native copier, places not aligned
        pool pages, a GPU pool, another dtype, rows not contiguous): the caller gathers and copies."""
        native = chunk_io.load() if self.paged else None
        if native is None:
            return False
        k_buf, v_buf = self.k_buffers[layer], self.v_buffers[layer]
        H, D = k_buf.shape[1:]
        if not (
            x.device.type == k_buf.device.type == v_buf.device.type == "cpu"
            and x.dtype == k_buf.dtype == v_buf.dtype
            and x.shape[2:] == (H, D)
            and x.stride()[1:] == (H * D, D, 1)
            and k_buf.is_contiguous()
            and v_buf.is_contiguous()
        ):
            return False
        span = self.chunk * H * D * x.element_size()  # one chunk's K (or V) rows, in the pool and in x
        pages = to[:, 0].cpu() // self.chunk * span
        rows = local * span
        # raw addresses: every span inside its tensor, or no copy at all
        if (
            int(local[-1] + 1) * self.chunk > x.shape[1]
            or int(pages.max()) + span > k_buf.numel() * k_buf.element_size()
        ):
            raise IndexError(f"chunks {int(local[-1])} / pages {int(pages.max()) // span} out of range")
        v_src = x.data_ptr() + x.stride(0) * x.element_size()
        spans = torch.cat(
            (
                torch.stack((k_buf.data_ptr() + pages, x.data_ptr() + rows), dim=1),
                torch.stack((v_buf.data_ptr() + pages, v_src + rows), dim=1),
            )
        )
        native.copy_spans(spans, span)
        return True

    def _pages_kv(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Chunks read into pool ``pages`` of ``layer``, as a read returns them: [2, n, c, H, D] (a copy)."""
        k_buf, v_buf, c = self.k_buffers[layer], self.v_buffers[layer], self.chunk
        return torch.stack([b.view(-1, c, *b.shape[1:])[pages] for b in (k_buf, v_buf)])

    def _put(self, layer: int, kv: torch.Tensor, to: torch.Tensor) -> None:
        """Copy chunks ``kv`` [2, n, c, H, D] (any strides: a view of the read buffer) into the pool
        slots ``to`` [n, c] of ``layer``: one copy per K and V, page by page when the page cache's
        places are aligned pool pages (:meth:`attach`), else slot by slot."""
        k_buf, v_buf = self.k_buffers[layer], self.v_buffers[layer]
        c = self.chunk
        if self.paged:
            pages = (to[:, 0] // c).to(k_buf.device)
            for buf, x in ((k_buf, kv[0]), (v_buf, kv[1])):
                buf.view(-1, c, *buf.shape[1:]).index_copy_(0, pages, x.to(buf.device, buf.dtype))
            return
        to = to.flatten().to(k_buf.device)
        k_buf.index_copy_(0, to, kv[0].reshape(-1, *k_buf.shape[1:]).to(k_buf.device, k_buf.dtype))
        v_buf.index_copy_(0, to, kv[1].reshape(-1, *v_buf.shape[1:]).to(v_buf.device, v_buf.dtype))

    def _drop_bad(self, src: Source, layer: int, kv, at, mine, bad: list[int]):
        """Leave a layer's chunks whose extent failed its checksum out (counted, logged, never attended)."""
        failed = torch.tensor(bad) - src.lo + src.first
        self.bad_segments.add(src.seg_id)
        self.bad[layer, failed] = True
        self.stats.bad_extents += len(bad)
        logger.warning(
            "loopkv: %d chunk extent(s) of segment %s layer %d failed their checksum: left out of the new turn's "
            "attention",
            len(bad),
            src.seg_id,
            layer,
        )
        good = torch.nonzero(~torch.isin(mine, failed)).flatten()
        return (None if kv is None else kv[:, good]), at[good], mine[good]

    def _release(self, layer: int, copied=None) -> None:
        self._bump((layer,))
        with self._cond:
            if copied is not None:
                self._copied[layer] = copied
            self._pending[layer] -= 1
            if not any(self._pending):
                self._idle_since = time.perf_counter()
            self._cond.notify_all()

    def settle(self) -> None:
        """Wait for every queued read (before the slots are freed or the files closed; on a GPU the
        forward's stream waits for the copies too, so the freed slots' next writes come after them)."""
        self._wait_for(range(self.num_layers), count=False)

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
            if self.kept_tokens[p] is not None:
                ok &= self.kept_tokens[p]
            used += int(ok.sum())
        self.stats.bytes_used = used * self.layer_bytes // self.chunk
        self.stats.prefetched_bytes = self.n_prefetched * self.layer_bytes
        self.stats.wasted_prefetch_bytes = self.n_wasted * self.layer_bytes
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
        self.settle()
        self.closed = True
        for src in self.sources:
            if src.fd is not None:
                os.close(src.fd)
                src.fd = None

    def offer_reads(self) -> None:
        """After :meth:`close`: offer what the prefill read from disk to the host chunk cache (the
        scheduler calls this once the batch's outputs are streamed)."""
        offers, self._offers = self._offers, []
        for src, *rest in offers:
            if src.seg_id not in self.bad_segments:
                src.cache.offer(src.seg_id, *rest)


@dataclass
class ChunkReader:
    """One thread that runs every restore's reads in the order they were queued (on a GPU its
    copies go to one stream per device: :class:`CopyStream`)."""

    _queue: queue.Queue = field(default_factory=queue.Queue)
    _thread: threading.Thread | None = None
    _streams: dict = field(default_factory=dict)

    def copies(self, device: torch.device) -> CopyStream:
        if device not in self._streams:
            self._streams[device] = CopyStream(device)
        return self._streams[device]

    def submit(self, job: PrunedRestore, layers: range, chunks: torch.Tensor, dst: torch.Tensor, after=None) -> None:
        self._put(functools.partial(job.load, layers, chunks, dst, after))

    def advise(self, job: PrunedRestore, jobs: list[tuple[range, torch.Tensor]]) -> None:
        self._put(functools.partial(job.advise, jobs))

    def _put(self, work) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loopkv-chunk-reader", daemon=True)
            self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        keep_torch_on_this_thread()  # no OpenMP team of its own: it would slow every later forward
        while True:
            work = self._queue.get()
            if work is None:
                return
            work()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
