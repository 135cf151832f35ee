"""Causal attention of a prefill's float32 queries over a bfloat16 KV pool on bfloat16 matrix units, at
close to float32 accuracy (``prefill_attention.cpp``; its top comment is the contract).

:func:`sgl_loopkv.attention.executor.dense_attention` calls it for long extends over a bfloat16 pool on
CPUs with AMX-BF16 or AVX512-BF16 (read at run time); elsewhere, or with ``LOOPKV_NATIVE_PREFILL_ATTENTION=0`` or no
compiler, torch's float32 flash kernel over the widened keys runs as before.
"""

from __future__ import annotations

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("prefill_attention", "LOOPKV_NATIVE_PREFILL_ATTENTION", "prefill attention")


def load():
    """The compiled module (``flash_split``, ``available``) or None."""
    return EXTENSION.load()
