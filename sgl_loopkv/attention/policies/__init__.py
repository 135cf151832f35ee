"""Sparse-prefill selection policies: one interface, chosen by name (``--loopkv-prefill-policy``).

- ``loopserve`` (:mod:`.loopserve`): LoopServe's online vertical/slash lines to attention-mass
  coverage ``alpha`` on sampled rows of the new tokens.
- ``lserve`` (:mod:`.lserve`): LServe's static streaming heads (sink + local blocks), the rest dense,
  from a per-model calibration file (:mod:`sgl_loopkv.attention.calibration`).
- ``block`` (:mod:`.block`): block sparsity: per query block, the key blocks with the largest
  estimated attention mass up to ``alpha``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sgl_loopkv.attention.sparse_plan import SeqMask
from sgl_loopkv.registry import Registry


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a policy may need to know about the served model. ``name``: the model folder's name
    (calibration files are keyed by it)."""

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int


class SelectionPolicy(ABC):
    """Chooses which keys the new rows of one sequence attend to, in one layer.

    ``select`` gets the layer's (post-RoPE) queries of the ``n`` new rows, q [n, num_q_heads,
    head_dim], and all ``L`` keys of the sequence, k [L, num_kv_heads, head_dim], whose last ``n``
    are the new rows' own (rows sit at positions L - n .. L - 1: a chunked-prefill extend after a
    cached prefix has L > n). It returns a :class:`SeqMask` at ``block_size``, one pattern per KV
    head (GQA: a group's query heads share their KV head's keys).

    Contract (tests/unit/test_sparse_policies.py): no query row is ever empty (SeqMask keeps every
    diagonal block); at full budget the mask holds every causal key; the result is a deterministic
    function of its inputs.
    """

    block_size: int

    @abstractmethod
    def select(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> SeqMask: ...


def dense_tail_blocks(table: torch.Tensor, kv_len: int, q_len: int, block_size: int, tail: int) -> torch.Tensor:
    """Select every block for the query blocks that hold the last ``tail`` new rows, in place
    (table [H, num_q_blocks, num_blocks] as :meth:`SeqMask.from_block_table` takes it).

    The last rows produce the first generated token, and in a chat prompt they are the question:
    their attention is exact in every layer for the price of ``tail / n`` of the dense work
    (LoopServe and MInference likewise look at the final query window). A superset of any
    selection, so coverage and monotonicity in alpha are kept."""
    if tail > 0:
        first = (kv_len - min(tail, q_len)) // block_size - (kv_len - q_len) // block_size
        table[:, first:] = True
    return table


def full_heads(mask: SeqMask, density: float) -> SeqMask:
    """``mask`` with the heads whose planned density is >= ``density`` made full (dense).

    Above roughly 0.6 a gathered sparse head costs about what dense attention does on CPU, and a
    full head is the dense kernel's most efficient call; every causal key is a superset of the
    selection, so fidelity only improves. ``density >= 1`` never converts."""
    if density >= 1:
        return mask
    L, P = mask.kv_len, mask.prefix_len
    causal = (L * (L + 1) - P * (P + 1)) // 2
    full = [f or cells >= density * causal for f, cells in zip(mask.full, mask.visible_cells())]
    if full == mask.full:
        return mask
    cols = [torch.empty(0, dtype=torch.int64) if f else mask.cols(h) for h, f in enumerate(full)]
    return SeqMask.from_block_table(mask.block_table(), L, mask.q_len, mask.block_size, cols, full)


#: name -> factory(config: SparsePrefillConfig, model: ModelShape) -> SelectionPolicy
POLICIES: Registry[SelectionPolicy] = Registry("prefill selection policy")

# Register the built-in policies (each module registers itself by name).
from sgl_loopkv.attention.policies import block, loopserve, lserve  # noqa: E402, F401

__all__ = ["POLICIES", "ModelShape", "SelectionPolicy"]
