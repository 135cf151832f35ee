"""Int8 stored KV (``--loopkv-tier-store-dtype int8``): 8-bit values with one symmetric scale per
(token, KV head) for K and one for V.

Why per token and head: a chunk, a token range or one layer can then be sliced, read and decoded
on its own (the tiers' units), and each scale sits in the same disk extent as its values. A
quarter of fp32's bytes plus one scale per token and head; the fidelity cost is small
(benchmarks/results/studies/store_codecs.md, docs/decisions/2026-11-23-int8-tiers-opt-in.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_loopkv.kernels import kv_quant

QMAX = 127


@dataclass(slots=True)
class QuantKV:
    q: torch.Tensor  # int8 [R, 2, T, H, D]
    scale: torch.Tensor  # float32 [R, 2, T, H]: value = q * scale

    @classmethod
    def quantize(cls, kv: torch.Tensor) -> QuantKV:
        """kv: [R, 2, T, H, D] of any float dtype. A contiguous float32 or bfloat16 CPU tensor goes
        through the native kernel (the same bits in one pass: a finished turn's store waits for it)."""
        native = kv_quant.load() if kv_quant.takes(kv) else None
        return cls(*(native.quantize(kv) if native is not None else quantize_torch(kv)))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def __getitem__(self, row: int) -> torch.Tensor:
        """Row ``row``'s [2, T, H, D], decoded to float32 (one fused int8 x float32 multiply: 11x
        faster on a CPU core than converting first)."""
        return torch.mul(self.q[row], self.scale[row].unsqueeze(-1))

    def keys(self) -> torch.Tensor:
        """Decoded keys of every row: [R, T, H, D] float32."""
        return torch.mul(self.q[:, 0], self.scale[:, 0].unsqueeze(-1))

    def slice_tokens(self, t0: int, t1: int) -> QuantKV:
        return QuantKV(self.q[:, :, t0:t1], self.scale[:, :, t0:t1])


def quantize_torch(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`QuantKV.quantize` in torch ops (any dtype and device; the native kernel's reference)."""
    x = kv.float()
    scale = x.abs().amax(-1) / QMAX
    q = (x / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(-QMAX, QMAX)
    return q.to(torch.int8), scale
