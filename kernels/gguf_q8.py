"""GGUF linear layers with int8 activations (``gguf_q8.cpp``), llama.cpp's decode arithmetic, compiled once per machine.

The file's top comment is the contract: each row of x quantized to 32-element int8 blocks (llama.cpp's
Q8_0 / Q8_1 rounding, float32 scales), integer block dots scaled once per block, one fixed float32
summation order per output whatever the batch, thread split or path. Not bitwise the float path
(``gguf_linear``): x is rounded to ~8 bits per block. :mod:`sgl_loopkv.models.gguf.linear` uses it when
``LOOPKV_GGUF_ACTIVATIONS=q8``.
"""

from __future__ import annotations

from sgl_loopkv.kernels.native import NativeExtension

#: -ffp-contract=off: the fixed order (the file's top) is spelled with explicit FMAs; nothing else fuses.
EXTENSION = NativeExtension("gguf_q8", "LOOPKV_NATIVE_GGUF_Q8", "GGUF int8-activation gemv", ("-ffp-contract=off",))


def load():
    """The compiled module, or None (no compiler, or ``LOOPKV_NATIVE_GGUF_Q8=0``)."""
    return EXTENSION.load()
