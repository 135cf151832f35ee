"""A whole read: every row's chunks of a range of one segment file into the rows tensors the tiers
keep ([R, 2, n * c, H, D]; an int8 tier's a QuantKV), every extent verified.

Natively (:func:`read_whole_native`, ``kernels/chunk_io.cpp``) each extent's pieces land straight in
their place in the rows tensors and their crc32 is checked there, without the GIL: a 4K-token
bfloat16 history read into a buffer in file order, checked extent by extent in Python and copied
into the rows' layout took about 1.7x the time its bytes took to come off the disk
(docs/decisions/2026-12-07-disk-resume-straight-into-its-rows.md). A sealed file's extents go the
same way through ``kernels/sealed_io.cpp`` (:func:`read_whole_sealed`: opened under their tags with
the process's libcrypto). :func:`read_whole` is the Python read, kept where neither is built. All
work in pieces of about :data:`~sgl_loopkv.cache.read_pacing.PIECE_BYTES`: a paced reader gives way
between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sgl_loopkv.cache import read_pacing
from sgl_loopkv.cache.cipher import TAG_BYTES, SegmentCipher
from sgl_loopkv.cache.layout import KVGeometry, SegmentFileLayout
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.segment_check import SegmentCheck
from sgl_loopkv.cache.segment_reads import ReadCounters, fetch
from sgl_loopkv.cache.segment_record import CorruptSegment


@dataclass(frozen=True, slots=True)
class _Plan:
    """A native whole read's destinations: every extent in file order (block by block, each block
    chunk-major) with its pieces' target addresses and its index in the file (crc32 table, unit)."""

    kv: torch.Tensor | QuantKV
    blocks: list
    targets: torch.Tensor  # [n, P] int64
    index: torch.Tensor  # [n] int64
    rows: torch.Tensor  # [n]: each extent's row (for the error)
    sizes: torch.Tensor  # [P] int64


#: ``empty(shape, dtype)``: where a read's rows go (``torch.empty``, or a codec's reused buffers:
#: :class:`~sgl_loopkv.cache.read_buffers.ReadBuffers`)
Empty = Callable[[tuple, torch.dtype], torch.Tensor]


def _torch_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _rows(g: KVGeometry, R: int, T: int, empty: Empty) -> tuple[torch.Tensor | QuantKV, tuple[torch.Tensor, ...]]:
    """Rows [R, 2, T, H, D] (a QuantKV for int8) and an extent's destinations, in file order."""
    H, D = g.num_kv_heads, g.head_dim
    if g.quantized:
        q, scale = empty((R, 2, T, H, D), torch.int8), empty((R, 2, T, H), torch.float32)
        return QuantKV(q, scale), (q, q, scale, scale)  # an extent: K values, V values, K scales, V scales
    kv = empty((R, 2, T, H, D), g.dtype)
    return kv, (kv, kv)  # an extent: K rows, V rows


def _plan(layout: SegmentFileLayout, g: KVGeometry, chunk_lo: int, chunk_hi: int, empty: Empty) -> _Plan:
    c, R, T = g.chunk_tokens, layout.rows, (chunk_hi - chunk_lo) * g.chunk_tokens
    kv, dests = _rows(g, R, T, empty)
    half = torch.tensor([p % 2 for p in range(len(dests))])  # the piece's K (0) or V (1) rows
    token_bytes = torch.tensor([d[0, 0, 0].numel() * d.element_size() for d in dests])
    base = torch.tensor([d.data_ptr() for d in dests])
    chunks = list(range(chunk_lo, chunk_hi))
    blocks = [b for g0 in range(0, R, layout.group) for b in layout.blocks(range(g0, layout.group_of(g0)[1]), chunks)]
    j = torch.cat([torch.arange(b.chunk0, b.chunk0 + b.n_chunks).repeat_interleave(b.row1 - b.row0) for b in blocks])
    r = torch.cat([torch.arange(b.row0, b.row1).repeat(b.n_chunks) for b in blocks])
    targets = base + ((r[:, None] * 2 + half) * T + (j[:, None] - chunk_lo) * c) * token_bytes
    return _Plan(kv, blocks, targets, layout.extent_indices(r, j), r, token_bytes * c)


def _read_planned(plan: _Plan, g: KVGeometry, seg_id: str, counters: ReadCounters, read):
    """``read(table, e0, e1) -> (ok, bytes, read seconds, verify seconds)`` over the plan's extents in
    pieces of about a megabyte, a paced reader's checkpoint between them. Raises CorruptSegment at
    the first extent in file order that is damaged or cut short."""
    per_call = max(read_pacing.PIECE_BYTES // g.extent_bytes, 1)
    e = 0
    for b in plan.blocks:
        count = b.n_chunks * (b.row1 - b.row0)
        for e0 in range(0, count, per_call):
            e1 = min(e0 + per_call, count)
            table = torch.tensor([[b.offset + e0 * g.extent_bytes, e1 - e0]], dtype=torch.int64)
            ok, nbytes, read_s, verify_s = read(table, e + e0, e + e1)
            counters.add(nbytes, 1, read_s, verify_s)
            if not bool(ok.all()):
                bad = int(plan.rows[e + e0 + int(torch.nonzero(~ok)[0, 0])])
                raise CorruptSegment(f"segment {seg_id}: truncated or checksum mismatch at row {bad}")
            read_pacing.checkpoint()
        e += count
    return plan.kv


def read_whole_native(
    native,
    fd: int,
    seg_id: str,
    layout: SegmentFileLayout,
    crcs: torch.Tensor,
    g: KVGeometry,
    counters: ReadCounters,
    chunk_lo: int,
    chunk_hi: int,
    empty: Empty = _torch_empty,
) -> torch.Tensor | QuantKV:
    """Rows of chunks [chunk_lo, chunk_hi) through ``native`` (the chunk_io module), into ``empty``'s
    tensors; ``crcs``: the header's extent crc32s as int64. Raises CorruptSegment."""
    plan = _plan(layout, g, chunk_lo, chunk_hi, empty)
    want = crcs[plan.index]

    def read(table, e0, e1):
        return native.read_extents(fd, table, plan.targets[e0:e1], want[e0:e1], plan.sizes, g.extent_bytes)

    return _read_planned(plan, g, seg_id, counters, read)


def read_whole_sealed(
    native,
    fd: int,
    seg_id: str,
    header: dict,
    layout: SegmentFileLayout,
    cipher: SegmentCipher,
    g: KVGeometry,
    counters: ReadCounters,
    chunk_lo: int,
    chunk_hi: int,
    empty: Empty = _torch_empty,
) -> torch.Tensor | QuantKV:
    """:func:`read_whole_native` for a sealed file through ``native`` (the sealed_io module): each
    extent opened under its tag instead of a crc32 check. Raises CorruptSegment."""
    plan = _plan(layout, g, chunk_lo, chunk_hi, empty)
    tags = torch.frombuffer(bytearray(header["_tags"]), dtype=torch.uint8).view(-1, TAG_BYTES)
    key, salt, sid = cipher.opener_key(), header["_salt"], header["seg_id"].encode()

    def read(table, e0, e1):
        return native.read_sealed(
            fd, table, plan.index[e0:e1], tags, plan.targets[e0:e1], plan.sizes, g.extent_bytes, key, salt, sid
        )

    return _read_planned(plan, g, seg_id, counters, read)


def read_whole(
    fd: int,
    seg_id: str,
    header: dict,
    layout: SegmentFileLayout,
    check: SegmentCheck,
    counters: ReadCounters,
    chunk_lo: int,
    chunk_hi: int,
    empty: Empty = _torch_empty,
) -> torch.Tensor | QuantKV:
    """Rows of chunks [chunk_lo, chunk_hi) in Python (into ``empty``'s tensors): each group's extents read (``preadv``) into one
    buffer in file order, [n, group rows, extent bytes], verified (crc32 or decryption), then copied
    once into the rows' layout. Raises CorruptSegment."""
    g = check.geometry
    n, eb, used = chunk_hi - chunk_lo, g.extent_bytes, g.chunk_tokens * g.token_bytes_per_layer
    c, H, D, R = g.chunk_tokens, g.num_kv_heads, g.head_dim, layout.rows
    groups: list[tuple[int, np.ndarray]] = []
    blocks, into = [], []
    for g0 in range(0, R, layout.group):
        g1 = layout.group_of(g0)[1]
        buf = np.empty((n, g1 - g0, eb), np.uint8)
        groups.append((g0, buf))
        for b in layout.blocks(range(g0, g1), list(range(chunk_lo, chunk_hi))):
            blocks.append(b)
            into.append(buf[b.chunk0 - chunk_lo : b.chunk0 - chunk_lo + b.n_chunks])
    for b, (_, ok) in zip(blocks, fetch(fd, layout, header, blocks, check, counters, into=into)):
        if not ok.all():
            bad = b.row0 + int(np.nonzero(~ok)[1][0])
            raise CorruptSegment(f"segment {seg_id}: truncated or checksum mismatch at row {bad}")
    step = max(read_pacing.PIECE_BYTES // (eb * max(layout.group, 1)), 1)  # chunks per piece of a group
    kv, _ = _rows(g, R, n * c, empty)
    if g.quantized:
        q, scale = kv.q, kv.scale
        qb = 2 * c * H * D
        for g0, buf in groups:
            raw, gr = torch.from_numpy(buf), buf.shape[1]
            for j in range(0, n, step):  # in pieces: a paced reader gives way between them
                k = min(j + step, n)
                q[g0 : g0 + gr].view(gr, 2, n, c, H, D)[:, :, j:k].copy_(
                    raw[j:k, :, :qb].view(torch.int8).view(k - j, gr, 2, c, H, D).permute(1, 2, 0, 3, 4, 5)
                )
                scale[g0 : g0 + gr].view(gr, 2, n, c, H)[:, :, j:k].copy_(
                    raw[j:k, :, qb:used].view(torch.float32).view(k - j, gr, 2, c, H).permute(1, 2, 0, 3, 4)
                )
                read_pacing.checkpoint()
        return kv
    out = kv
    for g0, buf in groups:
        raw, gr = torch.from_numpy(buf), buf.shape[1]
        for j in range(0, n, step):
            k = min(j + step, n)
            out[g0 : g0 + gr].view(gr, 2, n, c, H, D)[:, :, j:k].copy_(
                raw[j:k, :, :used].view(g.dtype).view(k - j, gr, 2, c, H, D).permute(1, 2, 0, 3, 4, 5)
            )
            read_pacing.checkpoint()
    return out
