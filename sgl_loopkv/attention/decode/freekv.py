"""``freekv``: FreeKV's speculative retrieval. The pages of step t are chosen with the query of
step t - 1 (on a GPU the recall of missing pages then overlaps step t - 1's compute); when the
mean cosine similarity of the two queries over a KV head's group falls below ``tau``, that head
is corrected: its pages are re-chosen with the step's own query (correction rate = corrected
heads / head decisions). One selection per step either way (the
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
        hkv = q.shape[0]
        self.decisions += hkv
        if spec is None:
            return fresh
        # per KV head: its group's mean similarity; drifted heads take the fresh pages
        sim = torch.nn.functional.cosine_similarity(q.float(), prev_q.float(), dim=-1).mean(-1)  # [Hkv]
        drift = sim < self.p.tau
        n_drift = int(drift.sum())
        if n_drift == 0:
            return spec
        self.corrections += n_drift
        if n_drift == hkv or spec[0].shape != fresh[0].shape or bool(spec[0][0, -1] != fresh[0][0, -1]):
            # a new last page or another page count: re-select every head (rows stay one length)
            self.corrections += hkv - n_drift
            return fresh
        # the mix reads positions up to the speculation's length from pages, the rest as local window
        return torch.where(drift[:, None], fresh[0], spec[0]), spec[1]
