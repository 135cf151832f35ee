"""LServe's static sparsity in prefill: streaming heads see only sink + local blocks, the other
(retrieval) heads stay dense.

Which (layer, KV head) pairs stream is decided once per model: a calibration file holds one
retrieval score per pair (:mod:`sgl_loopkv.attention.calibration`, procedure documented there) and
the ``streaming_fraction`` lowest-scoring pairs over all layers jointly stream (LServe thresholds
with a global quantile, so per-layer counts vary). A streaming head's row in query block b sees
key blocks ``0 .. sink/B - 1`` and ``b - local/B .. b``: block-granular, as LServe's kernel
iterates blocks. A window that covers the sequence (or a fraction of 0) is dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_loopkv.attention.calibration import load_head_scores
from sgl_loopkv.attention.policies import POLICIES, SelectionPolicy
from sgl_loopkv.attention.sparse_plan import SeqMask


@dataclass
class StreamingHeadsPolicy(SelectionPolicy):
    streaming: torch.Tensor  # bool [num_layers, num_kv_heads]: True = streaming head
    sink: int = 64  # tokens, a multiple of block_size
    local: int = 1024  # tokens before the diagonal block, a multiple of block_size
    block_size: int = 64

    def __post_init__(self):
        if self.sink % self.block_size or self.local % self.block_size:
            raise ValueError(
                f"streaming sink ({self.sink}) and local ({self.local}) must be multiples of the block size"
            )

    def select(self, layer_id, q, k, scale):
        n, L, H, B = q.shape[0], k.shape[0], k.shape[1], self.block_size
        full = [not bool(s) for s in self.streaming[layer_id]]
        nb, qb0 = -(-L // B), (L - n) // B
        qb, kb = torch.arange(qb0, nb)[:, None], torch.arange(nb)[None, :]
        pattern = (kb < self.sink // B) | (qb - kb <= self.local // B)
        return SeqMask.from_block_table(pattern.expand(H, -1, -1), L, n, B, full=full)


def streaming_heads(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool like ``scores`` [num_layers, num_kv_heads]: the round(fraction * count) lowest
    retrieval scores stream (ties: lower layer, then lower head first)."""
    count = round(fraction * scores.numel())
    order = torch.sort(scores.reshape(-1), stable=True).indices
    out = torch.zeros(scores.numel(), dtype=torch.bool)
    out[order[:count]] = True
    return out.view_as(scores)


@POLICIES.register("lserve")
def _create(config, model) -> StreamingHeadsPolicy:
    scores = load_head_scores(model.name, model.num_layers, model.num_kv_heads, config.streaming_calibration or None)
    return StreamingHeadsPolicy(
        streaming_heads(scores, config.streaming_fraction),
        sink=config.streaming_sink,
        local=config.streaming_local,
        block_size=config.block_size,
    )
