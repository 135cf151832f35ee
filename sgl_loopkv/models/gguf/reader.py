"""A GGUF file opened for serving from its blocks: every tensor a read-only view of the memory-mapped
file, in the block form llama.cpp wrote, never dequantized into a kept copy.

Opening checks the whole file first, so a server stops at start, not mid-request: a file that is not
GGUF, truncated or otherwise unreadable, or that holds a tensor of a block type the kernels do not
decode, raises :class:`GGUFError` naming the file (and the tensor and its type).
"""

from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from sgl_loopkv.kernels.gguf_linear import load

#: Block types the kernels decode (``kernels/gguf_linear.cpp``): the mixes behind Q4_K_M / Q5_K_M
#: files, the legacy 32-element types, and float tensors.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)


class GGUFError(ValueError):
    """A GGUF file that cannot be served: not GGUF, truncated, corrupt, or holding an unsupported type."""


def dequantize_rows(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of block rows (uint8 ``[rows, row_bytes]``), bitwise ``gguf.quants``'s."""
    module = load()
    if module is None or in_features % 32:
        out = quants.dequantize(blocks.numpy(), qtype).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(out)).view(-1, in_features)
    return module.dequantize(blocks.contiguous(), int(qtype), in_features, False)


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """One tensor of a GGUF file in its block form.

    ``shape`` is torch's order (``[out_features, in_features]`` for a linear layer's weight; GGUF
    stores the reverse). ``blocks`` is uint8 ``[rows, row_bytes]``, ``rows`` the product of every
    dimension but the last: a read-only view of the mapped file (writing to it faults)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    blocks: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 of the whole tensor (``shape``), or of the given rows ``[len(rows), in_features]``
        (an embedding lookup decodes only the rows it reads). Bitwise ``gguf.quants.dequantize``."""
        blocks = self.blocks if rows is None else self.blocks.index_select(0, rows.reshape(-1).long())
        out = dequantize_rows(blocks, self.qtype, self.in_features)
        return out.view(self.shape) if rows is None else out.view(*rows.shape, self.in_features)


#: GGUF metadata value types (gguf.GGUFValueType): struct formats of the scalars; 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian header fields from the mapped file (``gguf.GGUFReader`` builds a numpy
    view per field: ~30 s for a 49K-token vocabulary on a busy 2-core machine; this reads it in ~0.1 s)."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        return self.many(fmt)[0]

    def many(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past the end")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, n = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = f"<{n}{_SCALARS[item][1:]}"
                return list(self.many(fmt))
            return [self.value(item) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALARS[vtype])


class GGUFFile:
    """The tensors (:class:`BlockWeight`, by GGUF name) and metadata of one GGUF file (format v2/v3)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: not a GGUF file ({size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        try:
            if bytes(self._map[:4]) != b"GGUF":
                raise ValueError("bad magic (not a GGUF file)")
            cur.pos = 4
            version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
            self.fields = {}
            for _ in range(n_kv):
                key = cur.string()
                self.fields[key] = cur.value(cur.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name, n_dims = cur.string(), cur.scalar("<I")
                dims = [cur.scalar("<Q") for _ in range(n_dims)]
                infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({size} bytes; truncated or corrupt?): {e}") from e
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, BlockWeight] = {}
        for name, dims, type_id, offset in infos:
            self.tensors[name] = self._tensor(name, dims, type_id, data_start + offset, size)

    def _tensor(self, name: str, dims: list[int], type_id: int, start: int, size: int) -> BlockWeight:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            qtype = None
        if qtype not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise GGUFError(
                f"{self.path}: tensor {name!r} is {qtype.name if qtype else f'type {type_id}'}, a block type "
                f"sgl-loopkv does not decode (supported: {supported}); re-quantize the model (llama-quantize)"
            )
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest-varying dimension first
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or min(shape) < 1 or shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name!r} ({qtype.name}) has a corrupt shape {shape}")
        nbytes = int(np.prod(shape)) // block * type_size
        if start + nbytes > size:
            raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        with warnings.catch_warnings():  # the map is read-only on purpose: the weights are never written
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(self._map[start : start + nbytes].reshape(rows, -1))
        return BlockWeight(name, qtype, shape, blocks)

    def metadata(self, key: str, default=None):
        """A metadata value as Python (str, int, float, bool or a list of them), or ``default``."""
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata("general.architecture", ""))

    def __getitem__(self, name: str) -> BlockWeight:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor {name!r}") from None
