"""Krul's similarity estimator inside the loopkv attention: a per-request board of LayerStats.

The attention backend calls :meth:`KrulObserver.record` for every layer of every forward while the
feature is on (``--loopkv-share-layers`` != none); the cache takes a request's statistics with
:meth:`KrulObserver.pop` when its turn ends (one board per process, shared through
:mod:`sgl_loopkv.context`; the pattern of ``sgl_loopkv.cache.importance``). Everything runs in the scheduler
process.

Distances need the rows of *all* layers for the same query position, but a forward runs layer 0
for every row before layer 1. So per forward:

* sequences with at most ``EAGER_ROWS`` sampled rows (decode steps, tiny extends): the rows'
  probabilities are computed at each layer, reading the pool through run views (no prefix copy),
  and kept until the last layer ([layers, heads, rows, keys], a few MB);
* longer extends: only the rows' queries are kept per layer ([rows, heads, D], as small as the
  layer's input); at the last layer every layer's keys are in the pool, and
  :func:`~sgl_loopkv.krul.similarity.row_stats` recomputes the probabilities block by block of rows.

``prefill_stride`` > 1 samples rows at absolute positions that are multiples of the stride
(weighted by the stride), extend and decode rows alike: a decode step at any other position costs
one Python check per layer, not a second attention over the request's keys. Stride 1 is exact.
"""

from __future__ import annotations

import torch

from sgl_loopkv.krul.similarity import LayerStats, probs_stats, row_stats, stride_positions

EAGER_ROWS = 4


class KrulObserver:
    """The per-request board of :class:`LayerStats`. Off until configured (``--loopkv-share-layers``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.num_layers = 0
        self.stride = 1
        self._board: dict[int, LayerStats] = {}
        # this forward: the plan it belongs to, per sequence the sampled row offsets, per layer the saved data
        self._plan = None
        self._picks: list[torch.Tensor] = []
        self._saved: dict[int, list[torch.Tensor | None]] = {}
        self._sampled = False  # does this forward have any row on the sampling grid?

    def configure(self, enabled: bool, num_layers: int = 0, prefill_stride: int = 1) -> None:
        if enabled and num_layers < 2:
            raise ValueError("layer sharing needs the model's layer count (>= 2)")
        if prefill_stride < 1:
            raise ValueError("prefill stride must be >= 1")
        self.enabled, self.num_layers, self.stride, self._plan = enabled, num_layers, prefill_stride, None
        self._board.clear()
        self._saved.clear()

    def wants(self, layer_id: int, plan) -> bool:
        """Does this layer of this forward (``plan``) have rows to record? Never while off; on, only
        forwards with a row on the sampling grid, so most decode steps skip :meth:`record` entirely."""
        if not self.enabled:
            return False
        if plan is not self._plan or layer_id == 0:
            self._start(plan)
        return self._sampled

    def _start(self, plan) -> None:
        self._plan, picks = plan, []
        for i in range(plan.batch_size):
            first, last = plan.prefix_len(i), plan.kv_len(i)
            picks.append(stride_positions(first, last, self.stride) - first)
        self._picks = picks
        self._sampled = any(len(p) for p in picks)
        self._saved.clear()

    def _eager_probs(self, plan, i: int, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Probabilities [Hq, m, K] of sequence i's picked rows q [m, Hq, D] over its keys (causal)."""
        m, hq, d = q.shape
        hkv = k_cache.shape[1]
        group = hq // hkv
        K = plan.kv_len(i)
        qg = q.float().view(m, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * m, d)
        scores = q.new_empty(hkv, group * m, K, dtype=torch.float32)
        runs = plan.runs(i) or [(None, K)]
        at = 0
        for first, length in runs:
            k = plan.kv_of(i, k_cache) if first is None else k_cache[first : first + length]
            torch.bmm(qg, k.float().transpose(0, 1).transpose(1, 2), out=scores[:, :, at : at + length])
            at += length
        pos = plan.prefix_len(i) + self._picks[i]
        scores = scores.view(hkv, group, m, K).reshape(hq, m, K).mul_(scale)
        scores.masked_fill_(torch.arange(K)[None, None, :] > pos[None, :, None], float("-inf"))
        return scores.softmax(dim=-1)

    def record(self, layer_id: int, plan, req_rows: list[int], q: torch.Tensor, kv_pool, scale: float) -> None:
        """One layer of one forward: q [num_q_tokens, Hq, D] as the attention sees it (after RoPE),
        this layer's KV already written to ``kv_pool`` (``get_key_buffer(layer_id)``)."""
        if plan is not self._plan or layer_id == 0:
            self._start(plan)
        if not self._sampled:  # no row of this forward on the sampling grid (most decode steps)
            return
        k_cache = kv_pool.get_key_buffer(layer_id)
        per_seq = []
        for i in range(plan.batch_size):
            pick = self._picks[i]
            if len(pick) == 0:
                per_seq.append(None)
                continue
            rows = q[plan.qo_indptr[i] + pick]
            eager = len(pick) <= EAGER_ROWS
            per_seq.append(self._eager_probs(plan, i, rows, k_cache, scale) if eager else rows.clone())
        self._saved[layer_id] = per_seq
        L = self.num_layers
        if layer_id != L - 1:
            return
        if len(self._saved) != L:  # a forward that skipped layers: nothing consistent to add
            self._saved.clear()
            return
        for i, row in enumerate(req_rows):
            pick = self._picks[i]
            if len(pick) == 0:
                continue
            pos = plan.prefix_len(i) + pick
            if len(pick) <= EAGER_ROWS:
                stats = probs_stats(torch.stack([self._saved[layer][i] for layer in range(L)]), pos, float(self.stride))
            else:
                qs = torch.stack([self._saved[layer][i] for layer in range(L)])
                keys = [plan.kv_of(i, kv_pool.get_key_buffer(layer)) for layer in range(L)]
                stats = row_stats(qs, keys, pos, scale, float(self.stride))
            old = self._board.get(row)
            self._board[row] = stats if old is None else old + stats
        self._saved.clear()

    def pop(self, req_pool_idx: int) -> LayerStats | None:
        """The request's statistics since the last pop (its turn), removed from the board."""
        return self._board.pop(req_pool_idx, None)
