"""The IMPRESS-style baseline ContiguousKV compares with, as a chunk selection of chunk-pruned
restores (``--loopkv-prefix-selection impress``, registered when this module is imported: a server
started with ``LOOPKV_EXTENSIONS=benchmarks.baselines.impress``, as ``benchmarks/reprefill.py`` does).

At a period's first layer the full keys of that layer's whole history are read (the probe,
synchronous: the forward waits for it), the tokens are chosen by exact attention mass, and every
64-token block holding a chosen token is read for the period's other layers; attention reads the
chosen tokens only. Its page cache holds the whole history (a chunk's place is its index), its probe
and block padding are read but not used (its read amplification), and nothing is read ahead; decode
attends to the prefill's choice."""

from __future__ import annotations

import math

import torch

from sgl_loopkv.cache.chunk_selection import CHUNK_SELECTIONS, ContiguousChunks
from sgl_loopkv.selection.chunks import select_tokens, token_scores

NAME = "impress"


@CHUNK_SELECTIONS.register(NAME)
class ImpressSelection(ContiguousChunks):
    """Tokens chosen by exact mass over a probe of every key, read in ``block``-token blocks (at
    budget 1.0 every chunk is kept, as with ``chunks``)."""

    block = 64  # tokens a read block holds

    def capacity(self, n_chunks: int, budget: float) -> int:
        return n_chunks  # its blocks can lie anywhere

    def bind(self, job) -> None:
        super().bind(job)
        job.where[:] = torch.arange(job.n_chunks)  # the cache spans the history: a chunk's place is its index
        # per period, the history tokens attention reads [tokens] bool (None: every token of the kept chunks)
        self.kept_tokens: list[torch.Tensor | None] = [None] * len(job.kept)

    def token_mask(self, p: int) -> torch.Tensor | None:
        return self.kept_tokens[p]

    def select(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        if self.job.keep >= self.job.n_chunks:
            return super().select(layer, q, scale)
        return self._select_tokens(layer, q, scale)

    def _select_tokens(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Probe (read this layer's whole history and wait for it), choose tokens by exact mass, read
        their blocks for the period's other layers."""
        job = self.job
        p = job.period_of(layer)
        every = torch.arange(job.n_chunks)
        job.queue_reads(range(layer, layer + 1), every, prefetch=False)
        job.loads.wait_for(range(layer, layer + 1))
        valid = (job.loaded[layer] & ~job.bad[layer]).repeat_interleave(job.chunk)
        k_buf = job.k_buffers[layer]
        keys = k_buf[job.loads.slots_of(job.where[p], every).to(k_buf.device)]
        scores = token_scores(q.to(keys.device), keys, scale, valid)
        mask, chunks = select_tokens(
            scores, math.ceil(job.budget * job.tokens - 1e-9), job.chunk, job.local, self.block
        )
        job.mass += scores.view(job.n_chunks, job.chunk).sum(dim=1)
        job.kept[p], self.kept_tokens[p] = chunks, mask
        job.selected(p, chunks)
        job.queue_reads(range(layer + 1, min((p + 1) * job.period, job.num_layers)), chunks, prefetch=False)
        return chunks

    def decode_select(self, layer: int, q: torch.Tensor, scale: float, tau: float, serial: bool) -> None:
        """The baseline decodes over its last selection."""
