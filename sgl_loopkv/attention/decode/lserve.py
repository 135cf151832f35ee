"""``lserve``: LServe's hierarchical page selection (logical pages of 16 scored by key min/max,
physical pages of 64 read), reused for ``reuse`` decode steps (LServe's reusable page selector)."""

from __future__ import annotations

from sgl_loopkv.attention.decode.base import DecodePolicy


class LServePolicy(DecodePolicy):
    def choose(self, state, step, q, seq, scale):
        if state.pages is not None and step - state.selected_at < self.p.reuse:
            return None
        self.decisions += 1
        return self.by_bound(q, seq), seq.length
