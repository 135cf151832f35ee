"""The loading side of a chunk-pruned restore (:class:`ChunkLoads`): which (layer, chunk) reads are
asked, done or failed, the reads queued on the :class:`~sgl_loopkv.cache.chunk_reader.ChunkReader`
thread, their copies into the page cache's places, and the forward's waits for them.

Per restore, [num_layers, n_chunks] masks over the history's chunks::

    asked       queued or loaded (a read is never queued twice)
    loaded      in the pool (set by the reader thread)
    bad         its extent failed its checksum: never attended
    prefetched  queued ahead for the next period (wasted if that period drops it)
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from sgl_loopkv.cache.chunk_reader import ChunkReader, Source
from sgl_loopkv.cache.copy_stream import CopyStream
from sgl_loopkv.cache.page_copies import copy_host_native, host_chunks, pages_kv, put_chunks
from sgl_loopkv.cache.pruned_stats import PrunedStats

logger = logging.getLogger(__name__)


class ChunkLoads:
    """Reads of a history's chunks (``sources``) into the page cache ``slots`` of the pool layers
    ``k_buffers``/``v_buffers`` [slots, H, D], ``chunk`` slots per place; ``disk`` reads the disk
    sources. Counts into ``stats``."""

    def __init__(
        self,
        sources: list[Source],
        n_chunks: int,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        reader: ChunkReader,
        disk,
        chunk: int,
        gate: int,
        stats: PrunedStats,
    ):
        self.sources, self.n_chunks, self.chunk, self.gate, self.stats = sources, n_chunks, chunk, gate, stats
        self.k_buffers, self.v_buffers, self.reader, self.disk = k_buffers, v_buffers, reader, disk
        self.copies = reader.copies(k_buffers[0].device)  # on a GPU the reader's copies run on its stream
        self.num_layers = L = len(k_buffers)
        self.slots: torch.Tensor | None = None  # the device page cache (see attach)
        self.paged = False  # its places are aligned pool pages (see attach)
        self.loaded = torch.zeros(L, n_chunks, dtype=torch.bool)  # in the pool (reader thread)
        self.asked = torch.zeros(L, n_chunks, dtype=torch.bool)  # queued or loaded
        self.bad = torch.zeros(L, n_chunks, dtype=torch.bool)
        self.prefetched = torch.zeros(L, n_chunks, dtype=torch.bool)
        self.n_prefetched = 0  # (layer, chunk) reads queued ahead for the next period
        self.n_wasted = 0  # of those, dropped by that period's own selection
        self._pending = [0] * L
        self._copied: list = [None] * L  # CUDA: layer's latest copy event (reader.copies' stream)
        self._cond = threading.Condition()
        self._idle_since: float | None = None  # every queued read done (compute wait runs from here)
        self.in_prefill = True  # decode-time recalls are not waiting for a selection
        self.bad_segments: set[str] = set()  # segments with an extent that failed its checksum
        self._offers: list = []  # disk reads for the host chunk cache: (source, layers, chunks, rows per layer)
        # per layer, bumped by its period's selections and its own reads: the restore's kept-slot
        # cache key (a read of a later layer must not make every layer rebuild its slot list)
        self.version = [0] * L
        k0 = k_buffers[0]
        self.layer_bytes = 2 * chunk * k0.shape[1] * k0.shape[2] * k0.element_size()  # a chunk of a layer, K and V

    def attach(self, slots: torch.Tensor) -> None:
        """The page cache's pool slots, ``chunk`` per place."""
        self.slots = slots
        rows, c = slots.view(-1, self.chunk).cpu(), self.chunk
        # each place one aligned pool page (the paged allocator's): reads are copied in page by page
        self.paged = self.k_buffers[0].shape[0] % c == 0 and bool(
            ((rows[:, :1] % c == 0) & (rows == rows[:, :1] + torch.arange(c))).all()
        )

    def slots_of(self, places: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """The slots of ``chunks`` at their ``places`` (a period's chunk -> place map), in order."""
        return self.slots.view(-1, self.chunk)[places[chunks]].flatten()

    def forget(self, layers: range, dropped: torch.Tensor) -> None:
        """A period dropped these chunks (mask): their reads for its ``layers`` are forgotten (a read
        still queued for one lands before the read of the chunk that takes its place: one reader, in order)."""
        for layer in layers:
            self.n_wasted += int((self.prefetched[layer] & dropped).sum())
            for mask in (self.asked, self.loaded, self.prefetched, self.bad):
                mask[layer, dropped] = False

    # --- queueing (the forward's thread) ---------------------------------------------------------
    def queue(self, layers: range, chunks: torch.Tensor, places: torch.Tensor, prefetch: bool) -> None:
        """Queue the reads of ``chunks`` not yet asked for, for ``layers`` (one period's, its chunk ->
        place map ``places``): one job for each run of layers of one gate that miss the same chunks (a
        disk job reads them for all its layers at once, so a job spans no more than what a layer's
        compute waits for anyway)."""
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
            self._submit(job_layers, job_chunks, places, prefetch)

    def _submit(self, layers: range, todo: torch.Tensor, places: torch.Tensor, prefetch: bool) -> None:
        self.asked[layers.start : layers.stop, todo] = True
        self.prefetched[layers.start : layers.stop, todo] = prefetch
        self.n_prefetched += len(todo) * len(layers) if prefetch else 0
        with self._cond:
            if self._idle_since is not None and self.in_prefill and not any(self._pending):
                self.stats.compute_wait_s += time.perf_counter() - self._idle_since
            self._idle_since = None
            for layer in layers:
                self._pending[layer] += 1
        self.reader.submit(self, layers, todo, self.slots_of(places, todo), self.copies.submitted())

    def wait_for(self, layers: range, count: bool = True) -> None:
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

    def settle(self) -> None:
        """Wait for every queued read (before the slots are freed or the files closed; on a GPU the
        forward's stream waits for the copies too, so the freed slots' next writes come after them)."""
        self.wait_for(range(self.num_layers), count=False)

    # --- the reader thread -----------------------------------------------------------------------
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
                            if self.copy_host(kv, layer, mine - src.first, dst.view(-1, c)[at]):
                                kv = None  # in place already
                            else:
                                kv = host_chunks(kv, mine - src.first, c)
                        if kv is not None:
                            kv = kv.reshape(2, len(mine), c, *kv.shape[-2:])  # per chunk (a view: no copy)
                        if bad:
                            kv, at, mine = self._drop_bad(src, layer, kv, at, mine, bad)
                            if len(mine) == 0:
                                continue
                        if kv is not None:
                            put_chunks(
                                self.k_buffers[layer], self.v_buffers[layer], kv, dst.view(-1, c)[at], c, self.paged
                            )
                        self.loaded[layer, mine] = True
                        self.stats.bytes_loaded += len(mine) * self.layer_bytes
                    self._release(layer, self.copies.copied())
                    released += 1
            # offered once the request's output is out (:meth:`offer_reads`), not here: this thread's
            # Python work would hold the GIL against the forward; a decode-time recall's reads are not
            # offered (held until then, a long decode's would add up)
            if self.in_prefill:
                self._offers += [(src, layers, local, [kv for kv, _ in read]) for src, local, read in offers]
        except Exception:  # never leave the forward waiting; what did not load is not attended
            logger.exception("loopkv: reading chunks of layers %d-%d failed", layers.start, layers.stop - 1)
        finally:
            self.stats.reader_busy_s += time.perf_counter() - t0
            for layer in layers[released:]:
                self._release(layer)

    def advise(self, jobs: list[tuple[range, torch.Tensor]]) -> None:
        """Reader thread, before the first of ``jobs`` (one :meth:`queue`'s: a period's set, or its
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

    def copy_host(self, x: torch.Tensor, layer: int, local: torch.Tensor, to: torch.Tensor) -> bool:
        """Chunks ``local`` of a source's host KV ``x`` at ``layer`` copied natively into their pool
        pages ``to`` (:func:`~sgl_loopkv.cache.page_copies.copy_host_native`); False when the page
        cache's places are not aligned pool pages, or the copy cannot go that way."""
        if not self.paged:
            return False
        return copy_host_native(x, self.k_buffers[layer], self.v_buffers[layer], local, to, self.chunk)

    def _pages_kv(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        return pages_kv(self.k_buffers[layer], self.v_buffers[layer], pages, self.chunk)

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
        self.version[layer] += 1
        with self._cond:
            if copied is not None:
                self._copied[layer] = copied
            self._pending[layer] -= 1
            if not any(self._pending):
                self._idle_since = time.perf_counter()
            self._cond.notify_all()

    # --- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Reads finished, files closed."""
        self.settle()
        for src in self.sources:
            if src.fd is not None:
                os.close(src.fd)
                src.fd = None

    def offer_reads(self) -> None:
        """Offer what the prefill read from disk to the host chunk cache."""
        offers, self._offers = self._offers, []
        for src, *rest in offers:
            if src.seg_id not in self.bad_segments:
                src.cache.offer(src.seg_id, *rest)
