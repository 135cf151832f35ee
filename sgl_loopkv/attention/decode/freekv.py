"""``freekv``: FreeKV's speculative retrieval. The pages of step t are chosen with the query of
step t - 1 (on a GPU the recall of missing pages then overlaps step t - 1's compute); when the
cosine similarity of the two queries falls below ``tau`` in any KV head's group, the step is
corrected: its pages are re-chosen with its own query. One selection per step either way (the
correction's selection is also the next step's speculation); tau > 1 corrects every step, which
is exactly non-speculative retrieval."""

from __future__ import annotations

import torch

from sgl_loopkv.attention.decode.base import DecodePolicy


class FreeKVPolicy(DecodePolicy):
    def choose(self, state, step, q, seq, scale):
        prev_q, spec = state.last_q, state.next_pages
        state.last_q = q.clone()
        fresh = self.by_bound(q, seq), seq.length
        state.next_pages = fresh  # the speculation for the next step
        self.decisions += 1
        if spec is None:
            return fresh
        sim = torch.nn.functional.cosine_similarity(q.float(), prev_q.float(), dim=-1)  # [Hkv, g]
        if bool((sim < self.p.tau).any()):
            self.corrections += 1
            return fresh
        return spec
