"""Reading a segment file's key summaries (per layer, chunk and KV head the keys' min and max),
layer by layer, each layer verified on its own: what a chunk-pruned restore scores before it reads
any KV. Layout: :mod:`sgl_loopkv.cache.layout`."""

from __future__ import annotations

import os

import torch

from sgl_loopkv.cache.layout import SegmentFileLayout
from sgl_loopkv.cache.segment_check import SegmentCheck, crc32
from sgl_loopkv.cache.segment_reads import ReadCounters
from sgl_loopkv.cache.segment_record import CorruptSegment


def read_summaries(
    fd: int,
    seg_id: str,
    header: dict,
    check: SegmentCheck,
    counters: ReadCounters,
    layers: list[int] | None = None,
) -> torch.Tensor:
    """Key summaries [L, m, H, 2, D] (``summary_dtype``) of a whole segment, or [len(layers), ...] of
    the given layers only (small; read without touching KV). Each layer's block is verified by its
    own crc32 (files written before per-layer checksums: the whole block is read and verified)."""
    g = check.geometry
    layout = check.layout(header)
    block = layout.n_chunks * g.summary_bytes_per_chunk_layer
    crcs = header.get("summary_layer_crc32")
    if check.cipher is not None:  # sealed per layer: all layers are every layer's block
        layers = range(g.num_layers) if layers is None else layers
        return _sealed_summaries(fd, seg_id, header, layout, check, counters, layers)
    if layers is None or crcs is None:
        buf = os.pread(fd, g.num_layers * block, layout.summary_offset)
        counters.bytes_read += len(buf)
        if len(buf) != g.num_layers * block or crc32(buf) != header["summary_crc32"]:
            raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch")
        out = _summaries(check, buf, g.num_layers, layout.n_chunks)
        return out if layers is None else out[layers].clone()
    parts = []
    for layer in layers:  # the scored layers' blocks lie a period apart: in flight together, then read
        os.posix_fadvise(fd, layout.summary_offset + layer * block, block, os.POSIX_FADV_WILLNEED)
    for layer in layers:
        buf = os.pread(fd, block, layout.summary_offset + layer * block)
        counters.bytes_read += len(buf)
        if len(buf) != block or crc32(buf) != crcs[layer]:
            raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch at layer {layer}")
        parts.append(buf)
    return _summaries(check, b"".join(parts), len(layers), layout.n_chunks)


def _sealed_summaries(
    fd: int, seg_id: str, header: dict, layout: SegmentFileLayout, check: SegmentCheck, counters: ReadCounters, layers
) -> torch.Tensor:
    block = layout.n_chunks * check.geometry.summary_bytes_per_chunk_layer
    E, plain = layout.rows * layout.n_chunks, bytearray(len(layers) * block)
    for i, layer in enumerate(layers):
        buf = os.pread(fd, block, layout.summary_offset + layer * block)
        counters.bytes_read += len(buf)
        out = memoryview(plain)[i * block : (i + 1) * block]
        if len(buf) != block or not check.unit_ok(header, E + layer, buf, None, out):
            raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch at layer {layer}")
    return _summaries(check, bytes(plain), len(layers), layout.n_chunks)


def _summaries(check: SegmentCheck, buf: bytes, n_layers: int, n_chunks: int) -> torch.Tensor:
    g = check.geometry
    shape = (n_layers, n_chunks, g.num_kv_heads, 2, g.head_dim)
    if not buf:  # no layer asked for (a restore that scores nothing)
        return torch.empty(shape, dtype=g.summary_dtype)
    return torch.frombuffer(bytearray(buf), dtype=g.summary_dtype).view(shape)
