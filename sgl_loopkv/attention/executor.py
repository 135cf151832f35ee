"""Attention executors: run a plan over the KV pool. One interface, chosen by name.

An executor owns no scheduling decisions: it computes exactly the attention its plan describes.
The torch executor here is the CPU path (and the correctness reference for every other one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from sgl_loopkv.attention.plan import AttentionPlan
from sgl_loopkv.registry import Registry


class AttentionExecutor(ABC):
    """Computes ``out[rows of seq i] = softmax(q_i K_i^T * scale + causal mask) V_i`` for a plan.

    Shapes: ``q`` and ``out`` are [num_q_tokens, num_q_heads, head_dim]; ``k_cache``/``v_cache``
    are the pool's per-layer buffers [pool_slots, num_kv_heads, head_dim]. ``num_q_heads`` is a
    multiple of ``num_kv_heads`` (GQA: consecutive query heads share one KV head).
    """

    @abstractmethod
    def run(
        self,
        plan: AttentionPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor: ...


EXECUTORS: Registry[AttentionExecutor] = Registry("attention executor")


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """Attention of ``n`` new query rows over ``L >= n`` keys whose last ``n`` are the rows' own.

    q: [n, Hq, D]; k, v: [L, Hkv, D] -> [n, Hq, D]. With ``causal`` row ``r`` sees keys
    ``0 .. L - n + r``: only the new rows are computed, the cached prefix costs O(n * L), not
    O(L^2) (SGLang's torch_native pads q to L rows and runs a full causal square instead).
    """
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, D]
    if kh.dtype != qh.dtype:
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    mask, is_causal = None, False
    if causal and n == L:
        is_causal = True
    elif causal and n > 1:
        pos = torch.arange(L - n, L, device=q.device).unsqueeze(1)
        mask = torch.arange(L, device=q.device).unsqueeze(0) <= pos  # [n, L] True = attend
    # 4-D: with 3-D inputs CUDA SDPA falls back to its math kernel (65x slower at 8K on an H100,
    # out of memory at 32K); the CPU kernels are indifferent.
    o = F.scaled_dot_product_attention(
        qh[None],
        kh[None],
        vh[None],
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=qh.shape[0] != kh.shape[0],
    )
    return o[0].transpose(0, 1)


def attention_over_runs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: list[tuple[int, int]],
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """``dense_attention`` for a few query rows over keys that sit in the pool as ascending runs,
    reading each run through a view: no per-layer copy of the whole prefix (what dominates a short
    turn or a decode step over a long cached history). Exact: one softmax over all runs' scores.

    q: [n, Hq, D]; runs: [(first pool slot, length), ...] in position order -> [n, Hq, D].
    """
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    L = sum(length for _, length in runs)
    qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d).to(k_cache.dtype)
    scores = q.new_empty(hkv, g * n, L, dtype=torch.float32)
    pos = 0
    for first, length in runs:
        k = k_cache[first : first + length].transpose(0, 1)  # [Hkv, r, D] view
        if k.dtype == torch.float32:  # written in place
            torch.bmm(qg, k.transpose(1, 2), out=scores[:, :, pos : pos + length])
        else:  # bmm's out= must match its (half) inputs; softmax in fp32 all the same
            scores[:, :, pos : pos + length] = torch.bmm(qg, k.transpose(1, 2))
        pos += length
    scores.mul_(scale)
    if causal and n > 1:
        row_pos = (L - n + torch.arange(n, device=q.device)).repeat(g)  # [g * n], same order as qg rows
        scores.masked_fill_(torch.arange(L, device=q.device)[None, :] > row_pos[:, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(v_cache.dtype)
    out = torch.zeros(hkv, g * n, d, dtype=v_cache.dtype, device=q.device)
    pos = 0
    for first, length in runs:
        out.baddbmm_(probs[:, :, pos : pos + length], v_cache[first : first + length].transpose(0, 1))
        pos += length
    return out.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)


#: Query rows up to which the run-wise path beats gathering the prefix (decode, short turns).
RUNS_MAX_ROWS = 64


@EXECUTORS.register("torch")
class TorchDenseExecutor(AttentionExecutor):
    """Dense plans with torch SDPA, one sequence at a time (any device torch runs on)."""

    def run(self, plan, q, k_cache, v_cache, scale, out):
        for i in range(plan.batch_size):
            q0, q1 = plan.qo_indptr[i], plan.qo_indptr[i + 1]
            if q0 == q1:
                continue
            runs = plan.runs(i)
            if runs is not None and len(runs) > 1 and q1 - q0 <= RUNS_MAX_ROWS:
                out[q0:q1] = attention_over_runs(q[q0:q1], k_cache, v_cache, runs, scale, plan.causal)
            else:
                out[q0:q1] = dense_attention(
                    q[q0:q1], plan.kv_of(i, k_cache), plan.kv_of(i, v_cache), scale, plan.causal
                )
        return out
