"""A Llama layer's element-wise steps as one call each (``layer_ops.cpp``): RMSNorm with the residual
add, the neox rotary embedding of the query and key heads, SiLU(gate) * up, in float32.

The file's top comment is the contract: the rotary embedding bitwise torch's, the norm and the
activation within float32 rounding of it. :mod:`sgl_loopkv.models.lean_forward` calls them on the GGUF
path only (the float32 path stays bitwise SGLang's forward). ``LOOPKV_NATIVE_LAYER_OPS=0`` (or no
compiler) keeps SGLang's torch ops.
"""

from __future__ import annotations

from sgl_loopkv.kernels.native import NativeExtension

#: -ffp-contract=off: the rotary embedding's products and sums each rounded once, as torch's
EXTENSION = NativeExtension("layer_ops", "LOOPKV_NATIVE_LAYER_OPS", "layer element-wise ops", ("-ffp-contract=off",))


def load():
    """The compiled module (``rms_norm``, ``add_rms_norm``, ``rope_neox``, ``silu_mul``) or None."""
    return EXTENSION.load()
