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
    o = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=qh.shape[0] != kh.shape[0]
    )
    return o.transpose(0, 1)


@EXECUTORS.register("torch")
class TorchDenseExecutor(AttentionExecutor):
    """Dense plans with torch SDPA, one sequence at a time (any device torch runs on)."""

    def run(self, plan, q, k_cache, v_cache, scale, out):
        for i in range(plan.batch_size):
            q0, q1 = plan.qo_indptr[i], plan.qo_indptr[i + 1]
            if q0 == q1:
                continue
            out[q0:q1] = dense_attention(q[q0:q1], plan.kv_of(i, k_cache), plan.kv_of(i, v_cache), scale, plan.causal)
        return out
