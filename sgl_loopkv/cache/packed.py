"""A stored segment whose similar layer pairs share one row (Krul cross-layer sharing).

Layers not in a pair keep their own row; a pair (shallow, deep) is stored as one row plus the
codec's side data (:mod:`sgl_loopkv.krul.codec`: "reuse" keeps the shallow layer and serves it
for both, "minicache" stores a merged direction and per-token magnitudes). ``packed[l]`` decodes
layer ``l`` on access, so the loader thread decodes layer by layer while it copies, and a pair is
decoded once for both of its layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sgl_loopkv.cache.quant import QuantKV


def codec_of(name: str):
    from sgl_loopkv.krul.codec import CODECS

    return CODECS.create(name)


@dataclass(slots=True)
class PackedKV:
    rows: torch.Tensor | QuantKV  # [R, 2, T, H, D]
    layer_rows: tuple[int, ...]  # per layer: its row index in ``rows``
    pairs: tuple[tuple[int, int], ...]  # (shallow, deep) layer pairs; each shares one row
    codec: str
    side: list[dict[str, torch.Tensor]]  # per pair, the codec's side data
    _decoded: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def pack(cls, kv: torch.Tensor, pairs: list[tuple[int, int]], codec: str) -> PackedKV:
        """kv: [L, 2, T, H, D]; pairs: disjoint (shallow, deep) with shallow < deep."""
        c = codec_of(codec)
        pair_of = {layer: i for i, p in enumerate(pairs) for layer in p}
        rows, layer_rows, side = [], [], [None] * len(pairs)
        for layer in range(kv.shape[0]):
            i = pair_of.get(layer)
            if i is None:
                layer_rows.append(len(rows))
                rows.append(kv[layer])
            elif layer == pairs[i][0]:  # the shallow member (comes first): encode the pair here
                row, side[i] = c.encode(kv[pairs[i][0]], kv[pairs[i][1]])
                layer_rows.append(len(rows))
                rows.append(row)
            else:
                layer_rows.append(layer_rows[pairs[i][0]])
        return cls(torch.stack(rows), tuple(layer_rows), tuple(tuple(p) for p in pairs), codec, side)

    @property
    def num_layers(self) -> int:
        return len(self.layer_rows)

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[2]

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.rows) + sum(t.numel() * t.element_size() for s in self.side for t in s.values())

    def __getitem__(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s [2, T, H, D], decoded if it is in a pair."""
        for i, (shallow, deep) in enumerate(self.pairs):
            if layer in (shallow, deep):
                if layer in self._decoded:
                    return self._decoded.pop(layer)
                a, b = codec_of(self.codec).decode(self.rows[self.layer_rows[layer]], self.side[i])
                other, mine = (deep, a) if layer == shallow else (shallow, b)
                if other not in self._decoded:
                    self._decoded[other] = b if layer == shallow else a
                return mine
        return self.rows[self.layer_rows[layer]]

    def unpack(self) -> torch.Tensor:
        """[L, 2, T, H, D] of every layer (decoded)."""
        return torch.stack([self[layer] for layer in range(self.num_layers)])

    def slice_tokens(self, t0: int, t1: int) -> PackedKV:
        c = codec_of(self.codec)
        return PackedKV(
            slice_tokens(self.rows, t0, t1),
            self.layer_rows,
            self.pairs,
            self.codec,
            [c.slice_side(s, t0, t1) for s in self.side],
        )

    def header(self) -> dict:
        """What a reader needs besides the rows and side tensors (JSON)."""
        return {"layer_rows": list(self.layer_rows), "pairs": [list(p) for p in self.pairs], "codec": self.codec}


def slice_tokens(kv, t0: int, t1: int):
    """Tokens [t0, t1) of a stored segment's KV (a [L, 2, T, H, D] tensor, a QuantKV or a PackedKV)."""
    return kv[:, :, t0:t1] if isinstance(kv, torch.Tensor) else kv.slice_tokens(t0, t1)


def kv_nbytes(kv) -> int:
    return kv.numel() * kv.element_size() if isinstance(kv, torch.Tensor) else kv.nbytes


def quantize_rows(kv):
    """int8 tiers: the stored rows of a float [L, 2, T, H, D] tensor or of a PackedKV, quantized
    (a PackedKV's side data stays as its codec made it)."""
    if isinstance(kv, PackedKV):
        kv.rows = QuantKV.quantize(kv.rows)
        return kv
    return QuantKV.quantize(kv)


def stored_keys(kv) -> torch.Tensor:
    """Keys of every layer of an unpacked stored segment, [L, T, H, D] (decoded if int8)."""
    return kv.keys() if isinstance(kv, QuantKV) else kv[:, 0]
