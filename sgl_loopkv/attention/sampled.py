"""Exact attention of a few sampled query rows: what LoopServe's online line selection
(:mod:`.policies.loopserve`) and LServe's streaming-head calibration (:mod:`.calibration`) both
measure. Its own module so the calibration procedure does not import the policies that read its files."""

from __future__ import annotations

import torch


def sampled_attention(q_rows: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of sampled rows: q_rows [s, Hq, D] at positions ``pos`` [s] over
    k [L, Hkv, D] -> float64 [Hkv, s, L], averaged over each KV head's query heads (rows sum to 1)."""
    s, Hq, _ = q_rows.shape
    L, H, _ = k.shape
    qg = q_rows.view(s, H, Hq // H, -1)
    scores = torch.einsum("shgd,lhd->hgsl", qg, k.to(q_rows.dtype)).float() * scale
    scores.masked_fill_(torch.arange(L)[None, None, None, :] > pos[None, None, :, None], float("-inf"))
    return scores.softmax(-1).mean(1).double()
