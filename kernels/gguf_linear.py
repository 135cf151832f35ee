"""Linear layers on GGUF block weights (``gguf_linear.cpp``), compiled once per machine.

The file's top comment is the contract: chunks of 32 elements decoded exactly as the ``gguf``
package's numpy dequantization, one fixed float32 summation order per output whatever the batch,
thread split or path. :mod:`sgl_loopkv.models.gguf.linear` picks the path by rows of x.
"""

from __future__ import annotations

from sgl_loopkv.kernels.native import NativeExtension

#: -ffp-contract=off: a decoded weight is numpy's ``d * q + m`` with two roundings, never one FMA,
#: so the weights the kernels multiply are bitwise ``gguf.quants.dequantize``'s.
EXTENSION = NativeExtension("gguf_linear", "LOOPKV_NATIVE_GGUF", "GGUF block linear", ("-ffp-contract=off",))


def load():
    """The compiled module, or None (no compiler, or ``LOOPKV_NATIVE_GGUF=0``)."""
    return EXTENSION.load()
