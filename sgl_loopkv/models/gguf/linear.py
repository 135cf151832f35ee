"""``y = x @ W.T (+ b)`` for a weight in GGUF block form (:class:`~sgl_loopkv.models.gguf.reader.BlockWeight`).

By rows of x (thresholds from ``benchmarks/gguf_kernels.py`` on this project's CPUs):

- up to ``GEMV_MAX_ROWS`` (decode steps, short extends): ``gemv``, each weight row streamed from its
  blocks once per call and decoded in registers (1-2 rows) or into an L1 row buffer (more); each
  output one fixed-order float32 sum, so a row's result does not depend on the batch around it;
- more rows (prefill): ``gemm_dequant``, tiles of ``GEMM_TILE`` weight rows decoded to float32 and
  multiplied by torch's GEMM (MKL / oneDNN); the tile is the only float copy and lives for one call.
  With ``--loopkv-prefill-dtype bfloat16`` (:mod:`sgl_loopkv.models.precision`): ``gemm_bf16``, x and
  the weight rounded to bfloat16, float32 sums and results (oneDNN's brgemm: AMX, or AVX512-BF16's dot products), for a
  weight of a multiple of 64 rows; else the tiles and x rounded to bfloat16 through torch's bfloat16 GEMM.

``--loopkv-gguf-activations q8`` (opt-in) runs the gemv rows on int8 activations instead (``gguf_q8``:
x rounded per 32-element block as llama.cpp does, integer block dots): less work per weight, which
pays where the weights are in cache and little where they stream from memory, as in a served step
(``benchmarks/results/gguf_kernels.md``). The price is x's rounding to 8 bits per block: not bitwise the
dequantized model, and on the default model below the fidelity bar (docs/models.md), so ``float32``, the
exact path, is the default. Types or machines it does not cover keep the float path.

Without the compiled kernel (no compiler, ``LOOPKV_NATIVE_GGUF=0``) the weight is dequantized per call
with the ``gguf`` package (numpy) and multiplied by ``F.linear``: correct, slow, for a machine that
cannot build the kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from sgl_loopkv.kernels import gguf_q8
from sgl_loopkv.kernels.gguf_linear import load
from sgl_loopkv.models import precision
from sgl_loopkv.models.gguf.reader import BlockWeight, dequantize_rows

#: Rows up to which ``gemv`` is at least at par with dequantized tiles + torch's GEMM (the fastest calls of
#: benchmarks/results/gguf_kernels.md's prefill part, one thread, the AVX2 EPYC: at par or ahead at 16 rows, behind at 32).
GEMV_MAX_ROWS = 16
#: Weight rows per dequantized tile of the prefill path (at K = 576: 1.2 MB of float32, L2-sized).
GEMM_TILE = 512
#: Overrides ``--loopkv-gguf-activations`` in this process (tests, kernel benchmarks).
ACTIVATIONS_ENV = "LOOPKV_GGUF_ACTIVATIONS"
ACTIVATIONS = ("float32", "q8")
_chosen = "float32"  # the server's --loopkv-gguf-activations (use_activations, from the plugin)


def use_activations(mode: str) -> None:
    """This process's ``--loopkv-gguf-activations`` (the plugin passes the launched config's)."""
    global _chosen
    if mode not in ACTIVATIONS:
        raise ValueError(f"GGUF activations {mode!r}: expected one of {ACTIVATIONS}")
    _chosen = mode
    activations.cache_clear()
    _q8_types.cache_clear()


@functools.cache
def activations() -> str:
    """``q8`` or ``float32``: ``LOOPKV_GGUF_ACTIVATIONS`` if set, else the server's
    ``--loopkv-gguf-activations`` (:func:`use_activations`)."""
    value = os.environ.get(ACTIVATIONS_ENV, "").strip().lower() or _chosen
    if value not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_ENV}={value!r}: expected q8 or float32")
    return value


@functools.cache
def _q8_types() -> frozenset[int]:
    """The ggml types the int8-activation kernel takes (empty when it did not build)."""
    module = gguf_q8.load() if activations() == "q8" else None
    return frozenset(module.supported_types()) if module is not None else frozenset()


def linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T (+ bias)`` in float32 (x of any float dtype; the result in x's dtype)."""
    if x.shape[-1] != weight.in_features or len(weight.shape) != 2:
        raise ValueError(f"{weight.name}: x [..., {x.shape[-1]}] against a weight of shape {weight.shape}")
    flat = x.dim() == 2 and x.dtype == torch.float32  # a decode step's x: no view or cast to make
    x2 = x if flat else x.reshape(-1, x.shape[-1]).float()
    module = load()
    if module is None or weight.in_features % 32:
        y = F.linear(x2, dequantize_rows(weight.blocks, weight.qtype, weight.in_features), bias)
    elif x2.shape[0] <= GEMV_MAX_ROWS and int(weight.qtype) in _q8_types():
        y = gguf_q8.load().gemv_q8(x2, weight.blocks, int(weight.qtype), bias)
    elif x2.shape[0] <= GEMV_MAX_ROWS:
        y = module.gemv(x2, weight.blocks, int(weight.qtype), bias, -1)  # -1: the best instruction set built
    elif (bf16 := precision.bf16_rows(x2.shape[0])) and module.gemm_bf16_fits(weight.out_features, weight.in_features):
        y = module.gemm_bf16(x2, weight.blocks, int(weight.qtype), bias)
    else:
        y = module.gemm_dequant(x2, weight.blocks, int(weight.qtype), bias, GEMM_TILE, bf16)
    return y if flat else y.to(x.dtype).view(*x.shape[:-1], weight.out_features)
