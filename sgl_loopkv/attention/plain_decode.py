"""A plain dense CPU decode layer in two native calls, for the lean forward and the backend's own forward.

A decode step's attention through SGLang's layers is about ten Python frames and six tensor ops per
layer before the kernel runs (``RadixAttention.forward``, the backend's dispatch and checks, the pool's
``set_kv_buffer``: two casts and two indexed copies), which on two cores cost a few milliseconds of a
~20 ms step with the model's weights in GGUF blocks. When no mechanism watches the batch (no pruned
restore, sparse decode, delegate or layer-sharing observer), a layer is exactly: the new K/V rows
written to their slots in the pool's dtype, then the paged decode kernel over the batch's plan. This
does those two calls and nothing else, with the same kernels and values as the backend's own path
(``tests/unit/test_plain_decode.py`` holds them equal bit for bit).
"""

from __future__ import annotations

import os

import torch

from sgl_loopkv.attention.executor import DECODE_MIN_SPLIT, TorchDenseExecutor

ENV_SWITCH = "LOOPKV_PLAIN_DECODE"  # 0: every decode layer through SGLang's RadixAttention and the backend
#: pool dtypes the native store writes (SGLang's set_kv_buffer casts to the pool's dtype the same way)
STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pool_applies(pool) -> bool:
    """Is ``pool`` SGLang's plain MHA pool on the CPU, written as the native store writes it (no
    subclass overriding the write, no quantized or differently stored dtype, token-major rows)?"""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (
        isinstance(pool, MHATokenToKVPool)
        and type(pool).set_kv_buffer is MHATokenToKVPool.set_kv_buffer
        and type(pool).get_key_buffer is MHATokenToKVPool.get_key_buffer
        and str(pool.device) == "cpu"
        and pool.dtype in STORE_DTYPES
        and pool.store_dtype == pool.dtype
        and not getattr(pool, "is_quantized_kv_cache", False)
        and not getattr(pool, "use_hnd", False)
    )


def plain_native(executor, pool):
    """The native module the plain path calls, or None where it does not apply: another executor (the
    backend's torch executor without its native kernel, or a GPU one), another pool, or switched off."""
    native = getattr(executor, "native", None) if type(executor) is TorchDenseExecutor else None
    if native is None or os.environ.get(ENV_SWITCH, "1") == "0" or not hasattr(native, "store_kv"):
        return None
    return native if pool_applies(pool) else None


class PlainDecode:
    """One decode layer of one batch: ``__call__(layer, q, k, v)`` -> the attention output
    ``[rows, Hq * Dv]``, as :meth:`LoopKVAttnBackend.forward` returns it, or None for a layer it leaves to
    that path."""

    def __init__(self, native, pool, plan, loc: torch.Tensor, on_batch):
        self.native, self.pool, self.plan, self.on_batch = native, pool, plan, on_batch
        self.loc = loc if loc.dtype == torch.int64 and loc.is_contiguous() else loc.long().contiguous()

    def __call__(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        if (
            k is None
            or k.dtype != torch.float32
            or layer.k_scale is not None
            or layer.v_scale is not None
            or getattr(layer, "is_cross_attention", False)
            or (getattr(layer, "sliding_window_size", None) or -1) > -1
            or getattr(layer, "logit_cap", 0)
        ):
            return None  # the caller takes the backend's own path (which refuses what it cannot run)
        lid = layer.layer_id
        if lid == 0:
            self.on_batch()  # the backend's per-batch decode-path metric
        k_cache, v_cache = self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid)
        self.native.store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, self.loc)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim).contiguous()
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        self.native.paged_decode(
            q, k_cache, v_cache, self.plan.kv_indices, self.plan.kv_indptr_tensor, layer.scaling, out, DECODE_MIN_SPLIT
        )
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
