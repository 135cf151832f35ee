"""Linear layers of a decode step split over torch's threads (``decode_linear.cpp``).

For a few rows ATen runs a float32 (or bfloat16) linear layer on one thread (MKL's gemv / small
gemm), so a decode step reads its weights at one core's memory rate. :func:`linear` splits W's
output features over torch's threads and returns exactly what ``F.linear`` returns: each thread
runs MKL on a block of W's rows, which computes every output element as the unsplit call does
where MKL runs that call on one thread. For some shapes MKL threads the call itself and sums in
another order (float32 with 5-7 and 9-11 rows on MKL 2024.2), so every new (rows, W shape, dtype,
threads) is checked once on a random probe and keeps ``F.linear`` unless the two agree bitwise.
Above ``MAX_ROWS`` rows, or without the compiled kernel (``LOOPKV_NATIVE_LINEAR=0`` turns it off),
it is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("decode_linear", "LOOPKV_NATIVE_LINEAR", "decode linear")
#: Rows up to which the split wins: SmolLM2's 30 layers of linears with cold weights, float32, 2
#: cores (NOTES.md, 2026-11-24): 1.66x at 1 row, 1.45x at 32, 1.22x at 256, at par at 1024, where
#: MKL threads the call itself. Covers decode batches, short extends and the LM head's rows.
MAX_ROWS = 256


def load():
    return EXTENSION.load()


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` would take the split path for these operands."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    return (
        0 < rows <= MAX_ROWS
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == w.dtype
        and w.dim() == 2
        and w.is_contiguous()
        and torch.get_num_threads() > 1
        and load() is not None
    )


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
    """``F.linear(x, w, bias)``, bitwise, split over torch's threads where that is faster."""
    if not applies(x, w):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if not split_is_exact(x2.shape[0], w, bias):
        return F.linear(x, w, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return load().decode_linear(x2, w, bias).view(*x.shape[:-1], w.shape[0])
