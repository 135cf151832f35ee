"""A finished turn's KV into its stored form on the CPU (``kv_quant.cpp``): int8 rows with one scale per
row (:class:`sgl_loopkv.cache.quant.QuantKV`) and the per-chunk key summaries, each one pass over the
pool's bytes without the GIL. The store runs on the scheduler thread after a turn's last token, so
every request behind it waits for these. ``LOOPKV_NATIVE_KV_QUANT=0`` (or no compiler) keeps the torch
code, which gives the same bits.
"""

from __future__ import annotations

import torch

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("kv_quant", "LOOPKV_NATIVE_KV_QUANT", "KV quantization")


def load(verbose: bool = False):
    """The compiled module (``quantize(kv)``, ``chunk_minmax(k, chunk)``) or None."""
    return EXTENSION.load(verbose)


def _cpu_float(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x`` as it is (a contiguous float32 or bfloat16 CPU tensor)."""
    return _cpu_float(x) and x.is_contiguous()


def chunk_rows(k: torch.Tensor) -> torch.Tensor | None:
    """``k`` [..., T, H, D] as the [N, T, H, D] view ``chunk_minmax`` takes (each [T, H, D] contiguous,
    N strided), or None where no view has that form."""
    if not _cpu_float(k) or k.dim() < 3:
        return None
    T, H, D = k.shape[-3:]
    if k.stride(-1) != 1 or k.stride(-2) != D or k.stride(-3) != H * D:
        return None
    try:
        return k.view(-1, T, H, D)
    except RuntimeError:  # leading dims that do not merge into one stride
        return None
