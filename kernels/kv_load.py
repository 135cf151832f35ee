"""A restored layer into the CPU KV pool (``kv_load.cpp``): stored K/V rows, in the pool's dtype or int8
with their scales, copied (decoded) straight into the pool's slots, one read of each stored byte and one
write of each pool byte, without the GIL. The loader thread (:mod:`sgl_loopkv.cache.loader`) uses
it for float32 and bfloat16 pools on the CPU; ``LOOPKV_NATIVE_KV_LOAD=0`` (or no compiler) keeps the torch path
(``torch.mul``, the cast to the pool's dtype, ``index_copy_``), which gives the same bits.
"""

from __future__ import annotations

import torch

from sgl_loopkv.kernels.native import NativeExtension

#: the pool dtypes the kernel writes (a float16 or quantized pool keeps the torch path)
POOL_DTYPES = (torch.float32, torch.bfloat16)

EXTENSION = NativeExtension("kv_load", "LOOPKV_NATIVE_KV_LOAD", "KV loads")


def load(verbose: bool = False):
    """The compiled module (``load_layer(k, v, k_scale, v_scale, slots, k_dst, v_dst)``) or None."""
    return EXTENSION.load(verbose)


def fits(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``load_layer`` takes these rows ([T, H, D] in the pool's dtype, or int8) into this pool buffer."""
    return (
        dst.device.type == "cpu"
        and dst.dtype in POOL_DTYPES
        and dst.is_contiguous()
        and src.device.type == "cpu"
        and src.dtype in (dst.dtype, torch.int8)
        and src.dim() == 3
        and src.stride(2) == 1
        and src.stride(1) == src.shape[2]
        and src.shape[1:] == dst.shape[1:]
    )
