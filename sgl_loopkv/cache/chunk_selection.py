"""How a chunk-pruned restore chooses the history each period of layers attends to: one
:class:`ChunkSelection` per restore, picked by name (``--loopkv-prefix-selection``) from
:data:`CHUNK_SELECTIONS`. The package registers ``chunks`` (ContiguousKV, :class:`ContiguousChunks`);
a benchmark baseline registers its own from outside the package (``benchmarks/baselines/impress.py``,
loaded by :mod:`sgl_loopkv.extensions`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from sgl_loopkv.registry import Registry
from sgl_loopkv.selection.chunks import always_kept, chunk_scores, keep_count, select_chunks

if TYPE_CHECKING:
    from sgl_loopkv.cache.pruned import PrunedRestore

CHUNK_SELECTIONS: Registry[ChunkSelection] = Registry(
    "chunk selection",
    hint="the IMPRESS-style baseline ('impress') is registered by benchmarks/baselines/impress.py: "
    "run with LOOPKV_EXTENSIONS=benchmarks.baselines.impress",
)


class ChunkSelection(ABC):
    """The contract: at a period's first layer of the prefill, :meth:`select` chooses the period's
    history chunks from that layer's query rows and has the restore read them (``job.keep_period``,
    ``job.queue_reads``); during decode :meth:`decode_select` may choose again. Made (no arguments)
    before the restore exists, to size its page cache (:meth:`capacity`), then :meth:`bind` to it."""

    job: PrunedRestore

    def capacity(self, n_chunks: int, budget: float) -> int:
        """Chunk places of the page cache for a history of ``n_chunks`` chunks at ``budget``."""
        return keep_count(n_chunks, budget)

    def bind(self, job: PrunedRestore) -> None:
        self.job = job

    @abstractmethod
    def select(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """At a period's first layer: choose its chunks from the query rows q [n, Hq, D] and queue
        their reads; returns the chosen history chunk ids (ascending)."""

    def decode_select(self, layer: int, q: torch.Tensor, scale: float, tau: float, serial: bool) -> None:
        """At a period's first layer of a decode step (default: decode over the prefill's choice)."""
        return None

    def flush_recalls(self, skip: int | None) -> None:
        """Queue the reads decided by earlier decode selections (all but period ``skip``'s)."""
        return None

    def token_mask(self, p: int) -> torch.Tensor | None:
        """Period ``p``'s history tokens attention reads [tokens] bool; None: every token of its kept chunks."""
        return None


@CHUNK_SELECTIONS.register("chunks")
class ContiguousChunks(ChunkSelection):
    """ContiguousKV: whole chunks scored against their stored key summaries (no key is read), the best
    ``keep`` kept (the first and the ``local`` nearest always), the set read ahead for the next period;
    in decode, FreeKV-style re-selection with recall from the tiers."""

    def bind(self, job: PrunedRestore) -> None:
        super().bind(job)
        self._decode_q: dict[int, torch.Tensor] = {}  # period -> the decode query it last chose with
        self._recalls: dict[int, torch.Tensor] = {}  # period -> chunks chosen, recalled at the next period

    def select(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Choose, queue their reads for every layer of the period, then prefetch them for the next period."""
        job = self.job
        p = job.period_of(layer)
        if job.keep >= job.n_chunks:
            chunks = ahead = torch.arange(job.n_chunks)  # every period keeps them all: nothing is wasted
        else:
            scores = chunk_scores(q.to(job.summaries.device), job.summaries[p], scale, job.chunk)
            chunks = select_chunks(scores, job.keep, job.local)
            ahead = self._surest(chunks, scores)
            job.mass += scores
        prev = job.kept[p - 1] if p else None
        if prev is not None and len(chunks):  # what the prefetch of the previous period's set covered
            job.stats.overlap_sum += float(torch.isin(chunks, prev).float().mean())
            job.stats.overlaps += 1
        job.keep_period(p, chunks)
        job.selected(p, chunks)
        first, end = p * job.period, min((p + 1) * job.period, job.num_layers)
        job.queue_reads(range(first, end), chunks, prefetch=False)
        if end < job.num_layers and job.kept[p + 1] is None:  # ContiguousKV: the next period probably
            job.where[p + 1] = job.where[p]  # wants much the same chunks: the same places, read ahead
            job.queue_reads(range(end, min(end + job.period, job.num_layers)), ahead, prefetch=True)
        return chunks

    def _surest(self, chunks: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The part of a period's set read ahead for the next period: the always-kept chunks (first,
        nearest: certain to be kept again), then the best scored, ``prefetch`` of the set in all,
        and never fewer than two sets of ``keep`` out of ``n_chunks`` must share (2 keep - n_chunks:
        at budget 0.9 eight in nine of the set, at 0.5 and below none). Consecutive periods of
        SmolLM2 share about half their chunks at budget 0.1, and the best scored are only slightly
        likelier to stay (benchmarks/results/studies/prefetch_survival.md); at 0.75-0.9 reading nothing
        ahead left each period's reads waiting."""
        job = self.job
        forced = always_kept(job.n_chunks, job.keep, job.local)[chunks]
        n = max(int(forced.sum()), round(job.prefetch * len(chunks)), 2 * job.keep - job.n_chunks)
        order = torch.argsort(scores[chunks].masked_fill(forced, torch.inf), descending=True, stable=True)
        return chunks[order[:n]].sort().values

    # --- decode: FreeKV-style re-selection with recall from the tiers -----------------------------
    def decode_select(self, layer: int, q: torch.Tensor, scale: float, tau: float, serial: bool) -> None:
        """Reads decided at earlier periods are queued first (their layers of this step are done, so
        their places can be rewritten). Then, when the query drifted from the one this period last
        chose with (cosine < ``tau``), the period's chunks are chosen anew with it - used from the next
        step on (FreeKV's speculation: this step attends to the previous choice while the new chunks
        are recalled from the host or disk tier into the places of the dropped ones). ``serial``:
        recall now and wait (the reference the overlapped path must equal)."""
        job = self.job
        p = job.period_of(layer)
        self.flush_recalls(skip=p)
        qv = q.float().flatten()
        last = self._decode_q.get(p)
        if last is not None and float(torch.nn.functional.cosine_similarity(qv, last, dim=0)) >= tau:
            return
        self._decode_q[p] = qv
        if job.keep >= job.n_chunks or job.kept[p] is None:
            return
        scores = chunk_scores(q.to(job.summaries.device), job.summaries[p], scale, job.chunk)
        chunks = select_chunks(scores, job.keep, job.local)
        job.stats.decode_selections += 1
        if torch.equal(chunks, job.kept[p]):
            return
        self._recalls[p] = chunks
        if serial:
            self.flush_recalls(skip=None)
            for x in job.layers_of(p):
                job.wait(x)

    def flush_recalls(self, skip: int | None) -> None:
        for p in [x for x in self._recalls if x != skip]:
            self.job.recall(p, self._recalls.pop(p))
