"""Linear layers of a decode step on the CPU (``decode_linear.cpp``): a decode step is mostly its
linear layers, each a few rows against a weight matrix read from memory once.

- **float32, up to** ``GEMV_MAX_ROWS`` **rows, AVX-512**: ``gemv_f32``, our own kernel. MKL (inside
  torch) runs these calls on one thread, and on CPUs where it picks its generic kernels (the AMD
  EPYC here) at ~11 GB/s a thread; ``gemv_f32`` streams each weight row once for every row of x, W
  split over torch's threads, and from 3 rows on computes tiles of 4 weight rows x 4 rows of x in
  registers (where the FMAs, not memory, bound it: decode batches, a short turn's extend). Its sums
  are not MKL's order, so its bits are not ``F.linear``'s:
  each output is one fixed-order float32 sum, closer to the exact (float64) sum than MKL's in
  ``tests/unit/test_decode_linear.py``, and a row's result does not depend on the batch around it
  or on the thread count. ``LOOPKV_EXACT_LINEAR=1`` keeps ``F.linear``'s bits (the split below)
  for a server that must reproduce stock SGLang's float32 outputs bit for bit.
- **bfloat16, up to** ``GEMV_MAX_ROWS`` **rows, AVX512-BF16**: ``gemv_bf16``, the same kernel on the
  CPU's bf16 dot product (float32 sums of exact products, one fixed order, the bias added and the
  result rounded once to bfloat16, as oneDNN's bf16 linear does). oneDNN reads bf16 weights at ~15
  GB/s here; this kernel at ~30 (``benchmarks/studies/gemv.py``). Its bits are not oneDNN's either (they
  differ in the last bf16 place where the two float32 sums round apart); the same switch keeps those.
- **otherwise, up to** ``MAX_ROWS`` **rows** (more rows, no AVX-512, or exact mode): the
  split, bitwise ``F.linear``: W's output features over torch's threads, each thread running MKL
  on a block of W's rows, which computes every output element as the unsplit call does where MKL
  runs that call on one thread. For some shapes MKL threads the call itself and sums in another
  order (float32 with 5-7 and 9-11 rows on MKL 2024.2), so every new (rows, W shape, dtype,
  threads) is checked once on a random probe and keeps ``F.linear`` unless the two agree bitwise.

Above ``MAX_ROWS`` rows, or without the compiled kernel (``LOOPKV_NATIVE_LINEAR=0`` turns it off),
it is ``F.linear``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("decode_linear", "LOOPKV_NATIVE_LINEAR", "decode linear")
#: Rows up to which the split wins: SmolLM2's 30 layers of linears with cold weights, float32, 2
#: cores (docs/decisions/2026-11-27-decode-linears-without-mkl.md): 1.66x at 1 row, 1.45x at 32, 1.22x at 256, at par at 1024, where
#: MKL threads the call itself. Covers decode batches, short extends and the LM head's rows.
MAX_ROWS = 256
#: Rows up to which ``gemv_f32`` / ``gemv_bf16`` beat the split (SmolLM2's 30 layers of linears and its
#: LM head's one row, cold weights, 2 threads, AMD EPYC; ``benchmarks/results/studies/gemv.md``). Up to 2 rows memory
#: bounds them (1.4-2.3x the split); from 4 the FMAs do, and the register tile over 4 weight rows x 4
#: rows of x keeps them ahead of MKL's small gemm to ~32 float32 rows (1.3x at 16, 1.1x at 32, par at
#: 64) and of oneDNN to ~24 bf16 rows (1.5x at 16, 1.2x at 24, par at 32).
GEMV_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 24}
EXACT_ENV = "LOOPKV_EXACT_LINEAR"


def load():
    return EXTENSION.load()


@functools.cache
def gemv_for(dtype: torch.dtype):
    """The few-row kernel for ``dtype`` (``gemv_f32``, ``gemv_bf16``), or None: another dtype, not
    compiled here (no AVX-512 / AVX512-BF16), or ``LOOPKV_EXACT_LINEAR=1`` (every call
    ``F.linear``'s bits). Decided once per process and dtype: a decode step makes ~200 calls."""
    exact = os.environ.get(EXACT_ENV, "0").lower() in ("1", "true")
    module = load()
    if exact or module is None:
        return None
    if dtype == torch.float32 and module.has_gemv():
        return module.gemv_f32
    if dtype == torch.bfloat16 and module.has_gemv_bf16():
        return module.gemv_bf16
    return None


def takes_gemv(rows: int, w: torch.Tensor) -> bool:
    """Whether a call of ``rows`` rows against ``w`` (operands already checked by :func:`applies`)
    runs ``gemv_f32`` / ``gemv_bf16``."""
    return rows <= GEMV_MAX_ROWS.get(w.dtype, 0) and gemv_for(w.dtype) is not None


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` would take one of its kernels (``gemv_f32`` or the split) for these operands."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not (
        0 < rows <= MAX_ROWS
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == w.dtype
        and w.dim() == 2
        and w.is_contiguous()
        and load() is not None
    ):
        return False
    # the split needs two threads to gain; the gemv kernels gain on one as well (one worker per core)
    return torch.get_num_threads() > 1 or takes_gemv(rows, w)


#: (rows, out, in, dtype, bias?, threads) -> whether the split is bitwise F.linear for that shape.
_EXACT: dict[tuple, bool] = {}


#: Random probes per shape. In float32 a sum taken in another order differs in most outputs, so one
#: probe tells; rounded to bfloat16 / float16 it differs in a few outputs of 10^5 (on the AVX-512 BF16
#: Xeon: 1-10 of 37-147K for SmolLM2's 576 x 1536 at 64-256 rows, and one probe in 16 showed none),
#: so reduced precision takes 8 probes: a wrong "exact" would need all 8 to miss.
PROBES = {torch.float32: 1, torch.float64: 1}


def split_is_exact(rows: int, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the split computes ``F.linear`` bitwise for ``rows`` rows against ``w`` (checked
    once per shape on random probes: equal sums in another order would be a coincidence)."""
    key = (rows, *w.shape, w.dtype, bias is not None, torch.get_num_threads())
    exact = _EXACT.get(key)
    if exact is None:
        gen = torch.Generator().manual_seed(rows)
        exact = True
        for _ in range(PROBES.get(w.dtype, 8)):
            probe = torch.randn(rows, w.shape[1], generator=gen).to(w.dtype)
            exact = exact and torch.equal(load().decode_linear(probe, w, bias), F.linear(probe, w, bias))
        _EXACT[key] = exact
    return exact


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``: ``gemv_f32`` / ``gemv_bf16`` for a few float32 / bfloat16 rows
    (fixed-order sums, not ``F.linear``'s bits), else bitwise, split over torch's threads where that
    is faster."""
    if not applies(x, w):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if takes_gemv(x2.shape[0], w) and (bias is None or bias.dtype == w.dtype):
        return gemv_for(w.dtype)(x2.contiguous(), w, bias).view(*x.shape[:-1], w.shape[0])
    if torch.get_num_threads() < 2 or not split_is_exact(x2.shape[0], w, bias):
        return F.linear(x, w, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return load().decode_linear(x2, w, bias).view(*x.shape[:-1], w.shape[0])
