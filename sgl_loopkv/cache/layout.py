"""KV geometry and the on-disk segment layout: one 16-token chunk of one layer is one extent.

A *segment* is the KV of a run of whole chunks of one conversation (one radix-tree node when it
was stored). Segment file::

    offset 0        preamble   b"LOOPKV01" | u32 header_len | u32 crc32(header)        (16 B)
    offset 16       header     JSON: geometry, token ids, parent link, per-extent crc32s, and for
                               a packed segment its layer -> row map, pairs, codec, side tensors
    kv_offset       KV         grouped: rows in groups of G (header "layer_group"), and
                               for group [g0, g1), for chunk j, for row r in it: extent(r, j)
                               extent(r, j) = K[c, H, D] | V[c, H, D], zero-padded to 512 B
                               (int8 tiers: | K scales[c, H] | V scales[c, H], float32)
                               at kv_offset + (g0 * n_chunks + j * (g1 - g0) + r - g0) * extent_bytes
                               (row = layer, unless layer pairs share rows: sgl_loopkv.cache.packed;
                               G = 1 is plain layer-major order)
    summary_offset  summaries  for layer l, chunk j: per KV head min and max of the keys
                               [H, 2, D] float32 (float16 for narrower tiers; the selection step scores chunks on these
                               without reading full keys)
    side_offset     side data  packed segments only: the codec's tensors, one crc32

Why this shape: a chunk is the unit of selection, storage, I/O and caching (ContiguousKV), so
reading any chunk set is a set of aligned extents. A chunk-pruned restore reads one selected set
for every layer of a period, and a layer's compute waits for the reads of its sub-period gate (G =
the writer's ``--loopkv-prefix-gate``, 4), so a chunk's extents of one gate's layers are adjacent
and a run of adjacent selected chunks is one read for the whole gate; a group's chunks are
contiguous too (a whole-history load: a few reads per group). Grouped because cold reads on a
virtio disk cost per request more than per byte (layer-major order takes G times the reads:
docs/decisions/2026-11-26-grouped-segment-files.md); by the gate, not the period, because a read of a
whole period would hold every layer of it until the last byte (a streamed full history: slower).
``kv_offset`` is a multiple of 4 KiB and ``extent_bytes`` of 512 B (a sector: O_DIRECT-compatible on 512-byte-sector devices); fp32 and
bf16 extents of the served models are whole 4 KiB pages anyway, while an int8 chunk (6.4 KB for
SmolLM2) would waste a fifth of its bytes if padded to two pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_loopkv.selection.pages import chunk_minmax

ALIGN = 4096
SECTOR = 512
# A read's largest size: bigger ones cost CPU here (their buffer falls out of the cache between the
# read, the crc32 and the copy: a 4K history's whole load took +30% in 50 MB reads vs 6 MB ones)
MAX_READ_BYTES = 4 << 20
MAGIC = b"LOOPKV01"
PREAMBLE_BYTES = 16


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one token's KV across the model. ``dtype`` is the stored dtype (the pool's, or a
    narrower tier dtype; ``int8`` carries a float32 scale per token, KV head and K/V)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_tokens: int = 16

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def scale_bytes(self) -> int:
        """Per token, KV head and K/V: the int8 scale (0 for float dtypes)."""
        return 4 if self.quantized else 0

    @property
    def token_bytes_per_layer(self) -> int:
        """K and V of one token in one layer (bytes, scales included)."""
        return 2 * self.num_kv_heads * (self.head_dim * self.itemsize + self.scale_bytes)

    @property
    def extent_bytes(self) -> int:
        """One chunk of one layer on disk, padded to a 512-byte sector."""
        return align_up(self.chunk_tokens * self.token_bytes_per_layer, SECTOR)

    @property
    def summary_dtype(self) -> torch.dtype:
        """Key summaries are float32 next to fp32 KV, float16 next to narrower KV (where float32
        summaries would be a quarter of an int8 tier's bytes); fp16 rounding loosens the min/max
        bounds by at most 2^-11 relative, harmless for chunk scoring."""
        return torch.float32 if self.dtype == torch.float32 else torch.float16

    @property
    def summary_bytes_per_chunk_layer(self) -> int:
        return self.num_kv_heads * 2 * self.head_dim * torch.empty(0, dtype=self.summary_dtype).element_size()

    def segment_host_bytes(self, n_chunks: int) -> int:
        """RAM of a host-resident segment: KV of all layers plus key summaries."""
        t = n_chunks * self.chunk_tokens
        return self.num_layers * (t * self.token_bytes_per_layer + n_chunks * self.summary_bytes_per_chunk_layer)

    def to_json(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "chunk_tokens": self.chunk_tokens,
        }

    @classmethod
    def from_json(cls, d: dict) -> KVGeometry:
        return cls(d["num_layers"], d["num_kv_heads"], d["head_dim"], getattr(torch, d["dtype"]), d["chunk_tokens"])


@dataclass(frozen=True, slots=True)
class SegmentFileLayout:
    """Byte offsets inside one segment file (see the module docstring)."""

    geometry: KVGeometry
    n_chunks: int
    kv_offset: int
    n_rows: int | None = None  # stored KV rows: num_layers, fewer when layer pairs share a row
    side_bytes: int = 0  # layer-sharing side data after the summaries
    group: int = 1  # rows per group (1: layer-major)

    @property
    def rows(self) -> int:
        return self.geometry.num_layers if self.n_rows is None else self.n_rows

    def group_of(self, row: int) -> tuple[int, int]:
        """The rows [g0, g1) of ``row``'s group."""
        g0 = row - row % self.group
        return g0, min(g0 + self.group, self.rows)

    def extent_index(self, row: int, chunk: int) -> int:
        """Position of extent (row, chunk) in file order (its crc32's index in the header)."""
        g0, g1 = self.group_of(row)
        return g0 * self.n_chunks + chunk * (g1 - g0) + row - g0

    def extent_indices(self, rows: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """:meth:`extent_index` of every (row, chunk) pair of two broadcastable tensors."""
        g0 = rows - rows % self.group
        return g0 * self.n_chunks + chunks * (torch.clamp(g0 + self.group, max=self.rows) - g0) + rows - g0

    def extent_offset(self, row: int, chunk: int) -> int:
        return self.kv_offset + self.extent_index(row, chunk) * self.geometry.extent_bytes

    @property
    def summary_offset(self) -> int:
        return self.kv_offset + self.rows * self.n_chunks * self.geometry.extent_bytes

    @property
    def side_offset(self) -> int:
        g = self.geometry
        return self.summary_offset + g.num_layers * self.n_chunks * g.summary_bytes_per_chunk_layer

    @property
    def file_bytes(self) -> int:
        return self.side_offset + self.side_bytes

    def blocks(self, rows: range, chunks: list[int]) -> list[Block]:
        """Contiguous reads covering extents ``rows x chunks`` (chunks ascending): adjacent chunks
        coalesce (up to ``MAX_READ_BYTES`` a read) when ``rows`` spans whole groups (a gate's
        layers), else each chunk of each group is one read of the rows asked."""
        out: list[Block] = []
        r = rows.start
        while r < rows.stop:
            g0, g1 = self.group_of(r)
            r1 = min(rows.stop, g1)
            whole = r == g0 and r1 == g1
            most = max(1, MAX_READ_BYTES // ((r1 - r) * self.geometry.extent_bytes))  # chunks a read
            for j in chunks:
                last = out[-1] if out else None
                if (
                    whole
                    and last is not None
                    and last.row0 == r
                    and last.chunk0 + last.n_chunks == j
                    and last.n_chunks < most
                ):
                    last.n_chunks += 1
                else:
                    out.append(Block(self.extent_offset(r, j), r, r1, j, 1))
            r = r1
        return out


@dataclass(slots=True)
class Block:
    """One read: extents of chunks ``[chunk0, chunk0 + n_chunks)`` x rows ``[row0, row1)``, contiguous
    from ``offset`` in (chunk, row) order."""

    offset: int
    row0: int
    row1: int
    chunk0: int
    n_chunks: int

    def length(self, extent_bytes: int) -> int:
        return self.n_chunks * (self.row1 - self.row0) * extent_bytes


def key_summaries(k: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Per-chunk, per-KV-head min and max of keys.

    k: [L, T, H, D] with T a multiple of ``chunk_tokens`` -> [L, T / chunk_tokens, H, 2, D] float32.
    """
    return chunk_minmax(k, chunk_tokens)  # the scores of sparse decode and re-prefill read the same summaries


def baseline_block_read_bytes(token_ranges: list[tuple[int, int]], geometry: KVGeometry, block_tokens: int = 64) -> int:
    """Bytes a fixed ``block_tokens``-block layout (IMPRESS-style) reads to cover the same token
    ranges [start, end) (absolute positions), across all layers: every touched block is read whole."""
    blocks: set[int] = set()
    for start, end in token_ranges:
        blocks.update(range(start // block_tokens, (end - 1) // block_tokens + 1))
    return len(blocks) * block_tokens * geometry.token_bytes_per_layer * geometry.num_layers
