"""Reading one segment file from an open descriptor: its header, the KV of a chunk range or a chunk
set (into tensors, or natively straight into KV pool pages), a packed segment's side data and its
summaries, every part verified. Layout: :mod:`sgl_loopkv.cache.layout`; encoding:
:mod:`sgl_loopkv.cache.segment_encode`; files, names and sharing: :mod:`sgl_loopkv.cache.disk`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.layout import KVGeometry, SegmentFileLayout
from sgl_loopkv.cache.packed import PackedKV, codec_of
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.read_buffers import ReadBuffers
from sgl_loopkv.cache.segment_check import SegmentCheck
from sgl_loopkv.cache.segment_encode import SegmentEncoder
from sgl_loopkv.cache.segment_reads import PreadPool, ReadCounters, fetch
from sgl_loopkv.cache.segment_record import LAYER_GROUP, CorruptSegment, SegmentRecord
from sgl_loopkv.cache.segment_summaries import read_summaries
from sgl_loopkv.cache.segment_whole import read_whole, read_whole_native, read_whole_sealed


def _chunk_io():
    from sgl_loopkv.kernels import chunk_io  # built on first use (a C++ extension)

    return chunk_io.load()


def _sealed_io():
    from sgl_loopkv.kernels import sealed_io  # built on first use (a C++ extension)

    return sealed_io.load()


class ChunkRead(NamedTuple):
    """KV of a chunk set (:meth:`SegmentCodec.read_chunks`): ``kv`` [R, 2, n, c, H, D] (an int8
    tier's a QuantKV [R, 2, n * c, H, D]); ``bad``, per row the chunks that failed their checksum or
    were cut short (zero in ``kv``: never to be used)."""

    kv: torch.Tensor | QuantKV
    bad: list[list[int]]


@dataclass(slots=True)
class SegmentCodec:
    """Encodes and decodes segment files of one KV geometry; counts the bytes it reads. Files it
    writes group rows by ``layer_group`` (the writer's gate); it reads any grouping. With a
    ``cipher`` it writes and reads only sealed files (:mod:`sgl_loopkv.cache.cipher`): a unit's tag
    takes the place of its crc32, and a file it cannot open is a :class:`CorruptSegment`. Owns the
    threads of its parallel reads (:class:`PreadPool`: started on first use, :meth:`close`), or is
    given them (``readers``: an I/O controller's)."""

    geometry: KVGeometry
    layer_group: int = LAYER_GROUP
    cipher: SegmentCipher | None = None
    counters: ReadCounters = field(default_factory=ReadCounters)
    check: SegmentCheck = field(init=False, repr=False)
    encoder: SegmentEncoder = field(init=False, repr=False)
    readers: PreadPool = field(default_factory=PreadPool, repr=False)
    buffers: ReadBuffers = field(default_factory=ReadBuffers, repr=False)  # whole reads' rows, reused
    _crc_tables: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.check = SegmentCheck(self.geometry, self.cipher)
        self.encoder = SegmentEncoder(self.geometry, self.layer_group, self.cipher)

    def close(self) -> None:
        """Stop the read threads (a later parallel read starts them again)."""
        self.readers.close()

    @property
    def bytes_read(self) -> int:
        return self.counters.bytes_read

    @property
    def reads(self) -> int:
        """Extent reads issued (cold reads cost per request here, not per byte)."""
        return self.counters.reads

    @property
    def read_s(self) -> float:
        """Python-side reads (:meth:`read`, :meth:`read_chunks`): preads, summed over threads."""
        return self.counters.read_s

    @property
    def verify_s(self) -> float:
        """Their crc32s or decryption."""
        return self.counters.verify_s

    def encode(
        self, record: SegmentRecord, kv: torch.Tensor | PackedKV, summaries: torch.Tensor, writer: str
    ) -> list[bytes | memoryview]:
        """The file's bytes, in order (:meth:`SegmentEncoder.encode`)."""
        return self.encoder.encode(record, kv, summaries, writer)

    def header(self, fd: int, seg_id: str) -> dict:
        """The verified header of an open segment file (:meth:`SegmentCheck.header`)."""
        return self.check.header(fd, seg_id)

    def layout(self, header: dict) -> SegmentFileLayout:
        return self.check.layout(header)

    def read(
        self, fd: int, seg_id: str, chunk_lo: int, chunk_hi: int, first_chunk: list[int] | None = None
    ) -> torch.Tensor | PackedKV:
        """KV of chunks [chunk_lo, chunk_hi) for all layers -> [L, 2, T, H, D], every extent
        verified. Each group of rows read from the earliest chunk any of its rows needs; layer l
        starts at chunk ``first_chunk[l]`` when given (the chunks before it are left zero: the restorer
        recomputes them). A packed segment comes back as a PackedKV (its side data verified too).
        Raises CorruptSegment."""
        g = self.geometry
        header = self.header(fd, seg_id)
        layout = self.layout(header)
        layer_rows = header.get("layer_rows") or list(range(g.num_layers))
        if not first_chunk:
            rows = self._read_whole(fd, seg_id, header, layout, chunk_lo, chunk_hi)
            return self._packed(fd, seg_id, header, layout, rows, layer_rows, chunk_lo, chunk_hi)
        if first_chunk:  # a row shared by several layers is read from the earliest chunk any of them needs
            row_first = [chunk_hi] * layout.rows
            for layer, row in enumerate(layer_rows):
                row_first[row] = min(row_first[row], first_chunk[layer])
            first_chunk = row_first
        n, used = chunk_hi - chunk_lo, g.chunk_tokens * g.token_bytes_per_layer
        out = (np.zeros if first_chunk else np.empty)((layout.rows, n, used), np.uint8)
        lo = [max(chunk_lo, first_chunk[row]) if first_chunk else chunk_lo for row in range(layout.rows)]
        for g0 in range(0, layout.rows, layout.group):  # one read per group: from its rows' earliest chunk
            g1 = layout.group_of(g0)[1]
            start = min(lo[g0:g1])
            if start >= chunk_hi:
                continue
            blocks = layout.blocks(range(g0, g1), list(range(start, chunk_hi)))
            for b, (arr, ok) in zip(blocks, fetch(fd, layout, header, blocks, self.check, self.counters)):
                for r in range(b.row0, b.row1):
                    need = max(lo[r] - b.chunk0, 0)  # a row's chunks before its first are not used
                    if not ok[need:, r - b.row0].all():
                        raise CorruptSegment(f"segment {seg_id}: truncated or checksum mismatch at row {r}")
                    at = b.chunk0 + need - chunk_lo
                    out[r, at : at + b.n_chunks - need] = arr[need:, r - b.row0, :used]
        rows = self._rows_of_extents(torch.from_numpy(out))
        return self._packed(fd, seg_id, header, layout, rows, layer_rows, chunk_lo, chunk_hi)

    def _read_whole(
        self, fd: int, seg_id: str, header: dict, layout: SegmentFileLayout, chunk_lo: int, chunk_hi: int
    ) -> torch.Tensor | QuantKV:
        """Every row's chunks [chunk_lo, chunk_hi), verified -> rows [R, 2, n * c, H, D] (a QuantKV for
        int8), natively where it can (:mod:`sgl_loopkv.cache.segment_whole`). Raises CorruptSegment."""
        g, counters, empty = self.geometry, self.counters, self.buffers.empty
        if self.cipher is not None:  # opened under their tags (chunk_io checks crc32s, it cannot decrypt)
            if (sealed := _sealed_io()) is not None:
                return read_whole_sealed(
                    sealed, fd, seg_id, header, layout, self.cipher, g, counters, chunk_lo, chunk_hi, empty
                )
        elif (native := _chunk_io()) is not None:
            return read_whole_native(
                native, fd, seg_id, layout, self._crc_table(header), g, counters, chunk_lo, chunk_hi, empty
            )
        return read_whole(fd, seg_id, header, layout, self.check, counters, chunk_lo, chunk_hi, empty)

    def _packed(self, fd, seg_id, header, layout, rows, layer_rows, chunk_lo: int, chunk_hi: int):
        """``rows`` as read, or with the segment's shared layer pairs a PackedKV (its side data read and verified)."""
        g = self.geometry
        side = self._read_side(fd, seg_id, header, layout) if "side" in header else None
        if side is None:
            return rows
        c, codec = g.chunk_tokens, codec_of(header["codec"])
        return PackedKV(  # the rows cover [chunk_lo, chunk_hi), the side data the whole segment: slice it
            rows,
            tuple(layer_rows),
            tuple(tuple(p) for p in header["pairs"]),
            header["codec"],
            [codec.slice_side(sd, chunk_lo * c, chunk_hi * c) for sd in side],
        )

    def read_chunks(self, fd: int, seg_id: str, header: dict, rows: range, chunks: list[int]) -> ChunkRead:
        """KV of the given ascending chunks for ``rows`` (a gate's layers) -> (per row its chunks,
        per row the chunks whose extent failed its checksum or was cut short: their KV is zero and
        must not be used). One read per run of adjacent chunks and group
        (:meth:`SegmentFileLayout.blocks`). Unpacked segments only (``"side" not in header``).

        The KV is [len(rows), 2, n, c, H, D]: a strided view of the one buffer the reads land in
        (``preadv`` when every read spans all of ``rows``, the default where the gate is the file's
        group), so a chunk-pruned restore copies each chunk once more, into its pool page. An int8
        tier's rows come back as a QuantKV [len(rows), 2, n * c, H, D]."""
        g = self.geometry
        layout = self.layout(header)
        eb, used, R = g.extent_bytes, g.chunk_tokens * g.token_bytes_per_layer, len(rows)
        buf = np.empty((len(chunks), R, eb), np.uint8)  # chunk-major, as a whole group's reads are
        where = {j: i for i, j in enumerate(chunks)}
        bad: list[list[int]] = [[] for _ in rows]
        blocks = layout.blocks(rows, chunks)
        direct = all(b.row1 - b.row0 == R for b in blocks)
        into = [buf[where[b.chunk0] : where[b.chunk0] + b.n_chunks] for b in blocks] if direct else None
        reads = fetch(fd, layout, header, blocks, self.check, self.counters, self.readers, into)  # in flight together
        for b, (arr, ok) in zip(blocks, reads):
            at, r0 = where[b.chunk0], b.row0 - rows.start  # a block's chunks are adjacent in ``chunks`` too
            if not direct:
                buf[at : at + b.n_chunks, r0 : r0 + b.row1 - b.row0] = arr
            for i, r in zip(*np.nonzero(~ok)):
                bad[r0 + r].append(b.chunk0 + int(i))
        for r, chunks_bad in enumerate(bad):
            if chunks_bad:  # cut short or damaged: zeroed, and the caller leaves them out
                buf[[where[j] for j in chunks_bad], r] = 0
        raw = torch.from_numpy(buf)[:, :, :used]  # [n, R, used bytes]
        if g.quantized:
            return ChunkRead(self._rows_of_extents(raw.transpose(0, 1)), bad)
        c, H, D = g.chunk_tokens, g.num_kv_heads, g.head_dim
        return ChunkRead(raw.view(g.dtype).view(len(chunks), R, 2, c, H, D).permute(1, 2, 0, 3, 4, 5), bad)

    def read_chunks_into(
        self, fd: int, header: dict, rows: range, chunks: list[int], k_rows: list, v_rows: list, pages: torch.Tensor
    ) -> list[list[int]] | None:
        """:meth:`read_chunks` straight into KV pool pages, natively and without the GIL
        (:mod:`sgl_loopkv.kernels.chunk_io`): chunk ``chunks[i]`` of row ``rows[r]`` lands in page
        ``pages[i]`` of ``k_rows[r]`` / ``v_rows[r]`` ([slots, H, D] pool buffers, one chunk a page).
        -> per row, the chunks whose extent failed its checksum or was cut short (their pages hold
        whatever was read: the caller never attends to them); None when this read cannot go there
        (no native reader, an int8 tier, a pool of another dtype or layout, or reads that do not
        span every row of ``rows``): the caller uses :meth:`read_chunks`."""
        g = self.geometry
        native = _chunk_io() if self.cipher is None else None  # it checks crc32s, it cannot decrypt
        if native is None or g.quantized or not chunks:
            return None
        c, half = g.chunk_tokens, g.chunk_tokens * g.num_kv_heads * g.head_dim * g.itemsize
        for buf in (*k_rows, *v_rows):
            if buf.device.type != "cpu" or buf.dtype != g.dtype or not buf.is_contiguous() or buf.shape[0] % c:
                return None
            if buf[0].numel() * c * buf.element_size() != half:
                return None
        layout = self.layout(header)
        R = len(rows)
        blocks = layout.blocks(rows, chunks)
        if any(b.row1 - b.row0 != R for b in blocks):
            return None
        # extents in read order: chunk by chunk, each chunk's rows in order (a block is a run of chunks x all rows)
        index = layout.extent_indices(torch.arange(rows.start, rows.stop), torch.tensor(chunks)[:, None])  # [n, R]
        k_base = torch.tensor([b.data_ptr() for b in k_rows])
        v_base = torch.tensor([b.data_ptr() for b in v_rows])
        at = pages.to(torch.int64)[:, None] * half
        targets = torch.stack((k_base + at, v_base + at), dim=-1).reshape(-1, 2)
        crcs = self._crc_table(header)[index.flatten()]
        table = torch.tensor([[b.offset, b.n_chunks * R] for b in blocks], dtype=torch.int64)
        sizes = torch.tensor([half, half], dtype=torch.int64)
        ok, nbytes, read_s, crc_s = native.read_extents(fd, table, targets, crcs, sizes, g.extent_bytes)
        self.counters.add(nbytes, len(blocks), read_s, crc_s)
        bad: list[list[int]] = [[] for _ in rows]
        for i, row in torch.nonzero(~ok.view(len(chunks), R)).tolist():
            bad[row].append(chunks[i])
        return bad

    def _crc_table(self, header: dict) -> torch.Tensor:
        """The header's extent checksums as a tensor, kept for the few headers read last (every
        read of a restore indexes the same table)."""
        hit = self._crc_tables.get(id(header))
        if hit is None or hit[0] is not header:
            if len(self._crc_tables) >= 16:
                self._crc_tables.pop(next(iter(self._crc_tables)))
            hit = self._crc_tables[id(header)] = (header, torch.tensor(header["extent_crc32"], dtype=torch.int64))
        return hit[1]

    def advise(self, fd: int, header: dict, rows: range, chunks: list[int]) -> int:
        """Tell the kernel that :meth:`read_chunks` of ``rows x chunks`` comes soon (``WILLNEED`` on
        exactly its reads, started now and in flight together); -> bytes hinted. On this VM a period's
        scattered cold reads hinted first took 21 ms instead of 28-35 (the reads then find their pages
        in the page cache or in flight)."""
        blocks = self.layout(header).blocks(rows, chunks)
        eb = self.geometry.extent_bytes
        for b in blocks:
            os.posix_fadvise(fd, b.offset, b.length(eb), os.POSIX_FADV_WILLNEED)
        return sum(b.length(eb) for b in blocks)

    def _rows_of_extents(self, raw: torch.Tensor) -> torch.Tensor | QuantKV:
        """[R, n, used bytes] of verified extents -> rows [R, 2, n * c, H, D] (a QuantKV for int8)."""
        g = self.geometry
        R, n, c, H, D = raw.shape[0], raw.shape[1], g.chunk_tokens, g.num_kv_heads, g.head_dim

        def rows(b: torch.Tensor, dtype: torch.dtype, *tail: int) -> torch.Tensor:
            x = b.contiguous().view(dtype).view(R, n, 2, c, H, *tail)
            return x.transpose(1, 2).reshape(R, 2, n * c, H, *tail)

        if not g.quantized:
            return rows(raw, g.dtype, D)
        qb = 2 * c * H * D
        return QuantKV(rows(raw[..., :qb], torch.int8, D), rows(raw[..., qb:], torch.float32))

    def _read_side(self, fd: int, seg_id: str, header: dict, layout: SegmentFileLayout) -> list[dict]:
        buf = os.pread(fd, layout.side_bytes, layout.side_offset)
        self.counters.bytes_read += len(buf)
        plain = bytearray(len(buf)) if self.cipher is not None else None
        unit = layout.rows * layout.n_chunks + self.geometry.num_layers  # after the extents and summary layers
        if len(buf) != layout.side_bytes or not self.check.unit_ok(header, unit, buf, header.get("side_crc32"), plain):
            raise CorruptSegment(f"segment {seg_id}: side data checksum mismatch")
        raw, out = np.frombuffer(buf if plain is None else plain, np.uint8), []
        for entry in header["side"]:
            tensors = {}
            for name, (dtype, shape, off) in entry.items():
                dt = getattr(torch, dtype)
                nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
                tensors[name] = torch.from_numpy(raw[off : off + nbytes].copy()).view(dt).view(shape)
            out.append(tensors)
        return out

    def read_summaries(
        self, fd: int, seg_id: str, layers: list[int] | None = None, header: dict | None = None
    ) -> torch.Tensor:
        """Key summaries [L, m, H, 2, D] (``summary_dtype``) of a whole segment, or [len(layers), ...] of
        the given layers only, each layer verified (:func:`~sgl_loopkv.cache.segment_summaries.read_summaries`)."""
        header = header or self.header(fd, seg_id)
        return read_summaries(fd, seg_id, header, self.check, self.counters, layers)
