"""Pair codecs: two layers' KV of the same tokens stored as one row plus side data (Krul §6.1,
"our compression method follows MiniCache").

Layout: a layer's KV of T tokens is ``[2, T, H, D]`` (K then V). Side tensors carry the token axis
at dim 0, or hold token positions (``kept_pos``) that index the token axis, so a stored pair can be
cut at any token boundary (a radix node split) with :meth:`PairCodec.slice_side`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from sgl_loopkv.registry import Registry


class PairCodec(ABC):
    """Stores two layers' KV of the same tokens as one shared row plus side data."""

    name: str

    @abstractmethod
    def encode(self, shallow: Tensor, deep: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """shallow, deep: [2, T, H, D] (K and V of one layer each, pool dtype) -> (row [2, T, H, D] in the
        same dtype: what is stored in place of the two layers, side: codec extras; every side tensor has
        the token axis at dim 0 or is indexed by token positions so that `slice_side` works)."""

    @abstractmethod
    def decode(self, row: Tensor, side: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """-> (shallow, deep) restored, each [2, T, H, D] in row's dtype."""

    @abstractmethod
    def slice_side(self, side: dict[str, Tensor], t0: int, t1: int) -> dict[str, Tensor]:
        """side data of tokens [t0, t1) (a radix node can be split at a chunk boundary)."""

    def side_bytes(self, side: dict[str, Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in side.values())


CODECS: Registry[PairCodec] = Registry("pair codec")


@CODECS.register("reuse")
class ReuseCodec(PairCodec):
    """KVSharer-style: the deep layer reuses the shallow layer's KV verbatim (no side data)."""

    name = "reuse"

    def encode(self, shallow, deep):
        return shallow.clone(), {}

    def decode(self, row, side):
        return row, row.clone()

    def slice_side(self, side, t0, t1):
        return {}


def _slerp_dir(a: Tensor, b: Tensor, t: float) -> tuple[Tensor, Tensor]:
    """Unit directions of a, b [..., D] interpolated by SLERP at ``t`` (0 = a) -> (e, angle)."""
    ua = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    ub = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    cos = (ua * ub).sum(dim=-1, keepdim=True).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    small = sin < 1e-6  # (anti)parallel: SLERP is 0/0; normalised LERP is its limit for parallel rows
    wa = torch.where(small, 1.0 - t, torch.sin((1.0 - t) * omega) / torch.where(small, 1.0, sin))
    wb = torch.where(small, t, torch.sin(t * omega) / torch.where(small, 1.0, sin))
    e = wa * ua + wb * ub
    e = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    e = torch.where(e.norm(dim=-1, keepdim=True) > 0, e, ua)  # antiparallel at t = 0.5: keep a's side
    return e, omega.squeeze(-1)


@CODECS.register("minicache")
class MiniCacheCodec(PairCodec):
    """MiniCache merge: per (token, K/V, head) one shared direction ``e = SLERP(â, b̂; t)`` and both
    magnitudes; restore ``x̂ = ||x|| e``. Tokens whose largest angle between the two layers (over
    K/V and heads) is in the top ``retain`` fraction are kept verbatim (both layers).

    Stored: ``row = ||a|| e`` for merged tokens (the shallow magnitude rides in the row, so the
    side holds only the deep one) and ``row = a`` for retained ones; side ``deep_norm`` [T, 2, H]
    float32, ``kept_pos`` [n] int64, ``kept_deep`` [n, 2, H, D]. Guarantees: restored norms equal the
    originals up to rounding; retained tokens are bit-exact; a merged row's cosine to its original is
    ``cos(t * angle)`` (shallow) and ``cos((1 - t) * angle)`` (deep), angle <= the smallest retained
    angle. ``t = 0`` keeps the shallow layer bit-exact (row = shallow) and gives the deep layer the
    shallow direction with its own magnitudes. t = 0.5 minimises the larger of the two angular
    errors and gave the best greedy agreement (benchmarks/results/studies/krul_select.md); retain = 0.05 is
    MiniCache's order of magnitude (~3% bytes).
    """

    name = "minicache"

    def __init__(self, t: float = 0.5, retain: float = 0.05):
        if not 0 <= t <= 1 or not 0 <= retain <= 1:
            raise ValueError("minicache codec: t and retain must be in [0, 1]")
        self.t, self.retain = t, retain

    def encode(self, shallow, deep):
        a, b = shallow.float(), deep.float()
        e, angle = _slerp_dir(a, b, self.t)  # [2, T, H, D], [2, T, H]
        row = shallow.clone() if self.t == 0 else (a.norm(dim=-1, keepdim=True) * e).to(shallow.dtype)
        T = shallow.shape[1]
        n_keep = min(T, round(self.retain * T))
        worst = angle.amax(dim=(0, 2))  # [T]
        kept = torch.topk(worst, n_keep).indices.sort().values if n_keep else worst.new_zeros(0, dtype=torch.long)
        row[:, kept] = shallow[:, kept]
        side = {
            "deep_norm": b.norm(dim=-1).permute(1, 0, 2).contiguous(),  # [T, 2, H]
            "kept_pos": kept.to(torch.int64),
            "kept_deep": deep[:, kept].transpose(0, 1).contiguous(),  # [n, 2, H, D]
        }
        return row, side

    def decode(self, row, side):
        r = row.float()
        unit = r / r.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        deep = (unit * side["deep_norm"].permute(1, 0, 2).unsqueeze(-1)).to(row.dtype)
        kept = side["kept_pos"]
        deep[:, kept] = side["kept_deep"].transpose(0, 1).to(row.dtype)
        return row, deep

    def slice_side(self, side, t0, t1):
        pos = side["kept_pos"]
        sel = (pos >= t0) & (pos < t1)
        return {"deep_norm": side["deep_norm"][t0:t1], "kept_pos": pos[sel] - t0, "kept_deep": side["kept_deep"][sel]}
