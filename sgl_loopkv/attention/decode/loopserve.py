"""``loopserve``: LoopServe's progressive decode re-selection. A sequence's first ``dense_steps``
decode steps read every key (the paper's "decoding size" 16: its Algorithm 6 first selects at
n_o = 16); from then on, every ``n_d`` steps the pages are re-chosen from the attention of the
queries of the last ``n_d`` generated tokens (summed softmax mass per page, over the query heads of
each KV head's group): what the answer has been looking at, which holds up when the question is not
at the end of the prompt. Selecting at the first step from that step's query alone (``dense_steps``
0) lost the key-value retrievals of the multi-turn benchmark whose digits come ~15 tokens into the
answer, before any re-selection (docs/decisions/2026-11-25-sparse-decode-off-by-default.md)."""

from __future__ import annotations

import torch

from sgl_loopkv.attention.decode.base import DecodePolicy
from sgl_loopkv.selection.pages import group_sum


class LoopServePolicy(DecodePolicy):
    def choose(self, state, step, q, seq, scale):
        state.recent_q.append(q)
        del state.recent_q[: -self.p.n_d]
        if step < self.p.dense_steps:  # every page: the plan reads every key
            n = self.n_pages(seq.length)
            return torch.arange(n, device=q.device).expand(q.shape[0], n), seq.length
        if state.pages is not None and (step - self.p.dense_steps) % self.p.n_d:
            return None
        self.decisions += 1
        qs = torch.stack(state.recent_q, dim=2)  # [Hkv, g, r, D]
        hkv, g, r, d = qs.shape
        k = seq.keys()  # [L, Hkv, D]
        scores = torch.bmm(qs.reshape(hkv, g * r, d).to(k.dtype), k.permute(1, 2, 0)).float().mul_(scale)
        mass = scores.softmax(dim=-1).sum(dim=1)  # [Hkv, L]
        state.recent_q.clear()
        return self.top(group_sum(mass, self.p.page_size), seq.length), seq.length
