"""The sparse-executor contract and the per-sequence loop every executor shares.

A :class:`SparseExecutor` runs a :class:`~sgl_loopkv.attention.sparse_plan.SparsePlan` exactly:
sequences without a mask go to the backend's dense executor (so they get the dense path's numbers
even inside a sparse batch); the masked ones go to :meth:`SparseExecutor.run_masked`, which by
default calls :meth:`SparseExecutor.attend` one sequence at a time (an executor that batches every
masked sequence into one kernel call, like FlashInfer's, overrides ``run_masked`` instead).
"""

from __future__ import annotations

import torch

from sgl_loopkv.attention.executor import EXECUTORS, AttentionExecutor
from sgl_loopkv.attention.plan import AttentionPlan
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan


def one_sequence(base: AttentionPlan, i: int) -> AttentionPlan:
    """Sequence ``i`` of a dense plan as a plan of its own (its q rows start at 0)."""
    return AttentionPlan([0, base.q_len(i)], [0, base.kv_len(i)], base.kv_slots(i), base.causal, [base.runs(i)])


def run_dense(dense: AttentionExecutor, base: AttentionPlan, i: int, q, k_cache, v_cache, scale, out) -> None:
    """Sequence ``i`` exactly as the dense executor computes it."""
    q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
    dense.run(one_sequence(base, i), q[q0:q1], k_cache, v_cache, scale, out[q0:q1])


class SparseExecutor:
    """Computes, for every sequence of a :class:`SparsePlan`, softmax attention of its new rows
    over exactly the keys its mask lists (dense causal attention where the mask is None).

    Shapes as in :class:`~sgl_loopkv.attention.executor.AttentionExecutor`: ``q``/``out``
    [num_q_tokens, num_q_heads, head_dim], ``k_cache``/``v_cache`` [pool_slots, num_kv_heads,
    head_dim]; query head ``h`` uses KV head ``h // (num_q_heads // num_kv_heads)``.
    """

    def __init__(self, dense: AttentionExecutor | None = None):
        self.dense = dense or EXECUTORS.create("torch")

    def run(
        self,
        plan: SparsePlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        base, masked = plan.base, []
        for i, mask in enumerate(plan.masks):
            if base.q_len(i) == 0:
                continue
            if mask is None:
                run_dense(self.dense, base, i, q, k_cache, v_cache, scale, out)
            else:
                masked.append(i)
        if masked:  # rows of different sequences are disjoint: the order of the two parts is free
            self.run_masked(plan, masked, q, k_cache, v_cache, scale, out)
        return out

    def run_masked(self, plan: SparsePlan, seqs: list[int], q, k_cache, v_cache, scale: float, out) -> None:
        """The masked sequences ``seqs`` (non-empty, in batch order), written into ``out``."""
        base = plan.base
        for i in seqs:
            q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
            k, v = base.kv_of(i, k_cache), base.kv_of(i, v_cache)
            out[q0:q1] = self.attend(q[q0:q1], k, v, plan.masks[i], scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SeqMask, scale: float) -> torch.Tensor:
        """One sequence: q [n, Hq, D] over its keys k, v [L, Hkv, D] (position order) -> [n, Hq, Dv]."""
        raise NotImplementedError(f"{type(self).__name__} implements run_masked, not attend")
