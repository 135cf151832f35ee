"""Disk tier: segment files under a directory with a byte quota, crash-safe and checksummed.

Every write goes to a temp file that is fsync'ed and renamed into place, then the index is
rewritten the same way; a crash leaves either the old state or the new one. Every extent (one
chunk of one layer) and the header carry a crc32. A read that finds a missing, truncated or
corrupt file raises :class:`CorruptSegment`; the caller recomputes that part of the history
instead of serving it. A write that fails (a full disk: ``OSError``) leaves nothing behind, neither
a temp file nor an unindexed segment. Layout: :mod:`sgl_loopkv.cache.layout`.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from sgl_loopkv.cache.layout import MAGIC, PREAMBLE_BYTES, KVGeometry, SegmentFileLayout, align_up
from sgl_loopkv.cache.packed import PackedKV, codec_of
from sgl_loopkv.cache.quant import QuantKV

INDEX = "index.json"
# 2: extents padded to 512-byte sectors (were 4 KiB), float16 summaries next to narrower tiers,
# int8 tiers. An index of another version is not trusted (its files become orphans, deleted).
FORMAT_VERSION = 2


# Segment ids are minted by the cache (uuid4 hex), never taken from a request. Only plain names are
# file names: an index entry with anything else (a hand-edited or foreign index) is dropped, and
# path() refuses it, so no path can leave the directory.
SEG_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


class CorruptSegment(Exception):
    """A stored segment is missing, truncated or fails its checksum."""


@dataclass(slots=True)
class SegmentRecord:
    """Index entry of one stored segment. ``start`` is the position of its first token in the
    conversation; ``parent`` the segment holding the tokens just before it (None at position 0)."""

    seg_id: str
    parent: str | None
    start: int
    n_chunks: int
    file_bytes: int
    extra_key: str | None = None  # SGLang's RadixKey namespace (LoRA id, ...)
    cache_salt: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)  # in the file header, not the index

    def index_entry(self) -> dict:
        d = asdict(self)
        d.pop("token_ids")
        return d


def _atomic_write(path: Path, chunks, fsync_dir: bool = True) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        # 0o600: conversations are private to the server's user, whatever the umask
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written file would hold the space a full disk lacks
        raise
    if fsync_dir:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _to_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a CPU tensor (any dtype, bf16 included) as a uint8 array."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


class DiskSegmentStore:
    """Segment files ``seg_<id>.kv`` plus ``index.json`` in ``root``; never more than
    ``quota_bytes`` of segment files (the caller evicts before writing)."""

    def __init__(self, root: Path, quota_bytes: int, geometry: KVGeometry):
        self.root, self.quota_bytes, self.geometry = Path(root), quota_bytes, geometry
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.records: dict[str, SegmentRecord] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self._load_index()

    # --- index -------------------------------------------------------------------------------
    def _load_index(self) -> None:
        for tmp in self.root.glob("*.tmp"):  # an interrupted write: never committed
            tmp.unlink(missing_ok=True)
        path = self.root / INDEX
        if path.exists():
            try:
                index = json.loads(path.read_text())
                if index.get("version") != FORMAT_VERSION:
                    raise ValueError("format changed")
                if KVGeometry.from_json(index["geometry"]) != self.geometry:
                    raise ValueError("geometry changed")
                self.records = {
                    sid: SegmentRecord(**e)
                    for sid, e in index["segments"].items()
                    if SEG_ID.fullmatch(sid) and e.get("seg_id") == sid
                }
            except (ValueError, KeyError, TypeError, AttributeError):  # AttributeError: JSON, not an object
                self.records = {}  # unreadable or foreign index: start empty, files become orphans
        for sid in [sid for sid in self.records if not self.path(sid).exists()]:
            del self.records[sid]  # deleted while the index could not be rewritten (disk full), or by hand
        for f in self.root.glob("seg_*.kv"):  # written but never indexed (crash before the index)
            if f.stem.removeprefix("seg_") not in self.records:
                f.unlink(missing_ok=True)

    def _write_index(self) -> None:
        index = {
            "version": FORMAT_VERSION,
            "geometry": self.geometry.to_json(),
            "segments": {sid: r.index_entry() for sid, r in self.records.items()},
        }
        _atomic_write(self.root / INDEX, [json.dumps(index).encode()], fsync_dir=False)

    @property
    def used_bytes(self) -> int:
        return sum(r.file_bytes for r in self.records.values())

    def path(self, seg_id: str) -> Path:
        if not SEG_ID.fullmatch(seg_id):
            raise ValueError(f"not a segment id: {seg_id!r}")
        return self.root / f"seg_{seg_id}.kv"

    # --- write -------------------------------------------------------------------------------
    def file_bytes(self, n_chunks: int, n_tokens_ids: int) -> int:
        """Upper bound of a segment file's size before it is written (header estimate included)."""
        header = 4096 + 16 * n_tokens_ids + 24 * self.geometry.num_layers * n_chunks
        return SegmentFileLayout(self.geometry, n_chunks, align_up(PREAMBLE_BYTES + header)).file_bytes

    def write(self, record: SegmentRecord, kv: torch.Tensor | PackedKV, summaries: torch.Tensor) -> None:
        """Store ``kv`` ([L, 2, T, H, D] with T = n_chunks * chunk, or a PackedKV whose rows have
        that shape) and ``summaries`` [L, m, H, 2, D]."""
        g = self.geometry
        m, c = record.n_chunks, g.chunk_tokens
        packed = kv if isinstance(kv, PackedKV) else None
        rows = packed.rows if packed else kv
        R = rows.shape[0]
        assert rows.shape[1:] == (2, m * c, g.num_kv_heads, g.head_dim), rows.shape
        assert isinstance(rows, QuantKV) == g.quantized, "stored rows do not match the tier's dtype"

        def extents(t: torch.Tensor) -> np.ndarray:
            # [R, 2, m, c, H, ...] -> [R, m, 2, c, H, ...]: extent (r, j) = K | V of chunk j, contiguous
            t = t.reshape(R, 2, m, c, *t.shape[3:]).transpose(1, 2).contiguous()
            return _to_bytes(t).reshape(R * m, -1)

        raw = np.concatenate([extents(rows.q), extents(rows.scale)], 1) if g.quantized else extents(rows)
        pad = g.extent_bytes - raw.shape[1]
        if pad:
            raw = np.concatenate([raw, np.zeros((R * m, pad), np.uint8)], axis=1)
        crcs = [zlib.crc32(row) for row in raw]
        summary_raw = _to_bytes(summaries.to(g.summary_dtype))
        side_raw, side_meta = np.zeros(0, np.uint8), []
        if packed:
            blobs = []
            for side in packed.side:
                entry = {}
                for name, t in side.items():
                    b = _to_bytes(t.cpu())
                    entry[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), sum(len(x) for x in blobs)]
                    blobs.append(b)
                side_meta.append(entry)
            side_raw = np.concatenate(blobs) if blobs else side_raw
        header = {
            "seg_id": record.seg_id,
            "parent": record.parent,
            "start": record.start,
            "n_chunks": m,
            "extra_key": record.extra_key,
            "cache_salt": record.cache_salt,
            "geometry": g.to_json(),
            "token_ids": record.token_ids,
            "extent_crc32": crcs,
            "summary_crc32": zlib.crc32(summary_raw),
        }
        if packed:
            header |= packed.header() | {"rows": R, "side": side_meta, "side_crc32": zlib.crc32(side_raw)}
            header["side_bytes"] = len(side_raw)
        hbytes = json.dumps(header).encode()
        kv_offset = align_up(PREAMBLE_BYTES + len(hbytes))
        layout = SegmentFileLayout(g, m, kv_offset, R, len(side_raw))
        preamble = MAGIC + struct.pack("<II", len(hbytes), zlib.crc32(hbytes))
        gap = bytes(kv_offset - PREAMBLE_BYTES - len(hbytes))
        _atomic_write(
            self.path(record.seg_id),
            [preamble, hbytes, gap, raw.tobytes(), summary_raw.tobytes(), side_raw.tobytes()],
        )
        record.file_bytes = layout.file_bytes
        self.records[record.seg_id] = record
        try:
            self._write_index()
        except BaseException:  # not indexed, so not stored: never keep a file the index does not name
            self.records.pop(record.seg_id, None)
            self.path(record.seg_id).unlink(missing_ok=True)
            raise
        self.bytes_written += layout.file_bytes

    def delete(self, seg_id: str) -> None:
        """Forget a segment and remove its file. The file goes even when the index cannot be rewritten
        (a full disk: deleting is how space comes back); the stale entry then names a missing file,
        which the next index write drops, or the next start-up."""
        path = self.path(seg_id)
        self.records.pop(seg_id, None)
        try:
            self._write_index()
        except OSError:
            pass
        path.unlink(missing_ok=True)

    # --- read --------------------------------------------------------------------------------
    def read_header(self, seg_id: str) -> dict:
        try:
            with open(self.path(seg_id), "rb") as f:
                pre = f.read(PREAMBLE_BYTES)
                if len(pre) != PREAMBLE_BYTES or pre[:8] != MAGIC:
                    raise CorruptSegment(f"segment {seg_id}: bad preamble")
                hlen, hcrc = struct.unpack("<II", pre[8:])
                hbytes = f.read(hlen)
        except OSError as e:
            raise CorruptSegment(f"segment {seg_id}: {e}") from e
        if len(hbytes) != hlen or zlib.crc32(hbytes) != hcrc:
            raise CorruptSegment(f"segment {seg_id}: header checksum mismatch")
        header = json.loads(hbytes)
        header["kv_offset"] = align_up(PREAMBLE_BYTES + hlen)
        return header

    @staticmethod
    def _layout(g: KVGeometry, header: dict) -> SegmentFileLayout:
        return SegmentFileLayout(
            g, header["n_chunks"], header["kv_offset"], header.get("rows"), header.get("side_bytes", 0)
        )

    def read(
        self, seg_id: str, chunk_lo: int, chunk_hi: int, first_chunk: list[int] | None = None
    ) -> torch.Tensor | PackedKV:
        """KV of chunks [chunk_lo, chunk_hi) for all layers -> [L, 2, T, H, D], every extent
        verified. One coalesced read per layer; layer l starts at chunk ``first_chunk[l]`` when given (the
        chunks before it are left zero: the restorer recomputes them). A packed segment comes back as a
        PackedKV (one read per stored row, its side data verified too). Raises CorruptSegment."""
        g = self.geometry
        header = self.read_header(seg_id)
        layout = self._layout(g, header)
        layer_rows = header.get("layer_rows") or list(range(g.num_layers))
        if first_chunk:  # a row shared by several layers is read from the earliest chunk any of them needs
            row_first = [chunk_hi] * layout.rows
            for layer, row in enumerate(layer_rows):
                row_first[row] = min(row_first[row], first_chunk[layer])
            first_chunk = row_first
        crcs = header["extent_crc32"]
        n, used = chunk_hi - chunk_lo, g.chunk_tokens * g.token_bytes_per_layer
        out = (np.zeros if first_chunk else np.empty)((layout.rows, n, used), np.uint8)
        try:
            fd = os.open(self.path(seg_id), os.O_RDONLY)
        except OSError as e:
            raise CorruptSegment(f"segment {seg_id}: {e}") from e
        try:
            for row in range(layout.rows):
                lo = max(chunk_lo, first_chunk[row]) if first_chunk else chunk_lo
                for off, length in layout.runs(row, list(range(lo, chunk_hi))):
                    buf = os.pread(fd, length, off)
                    self.bytes_read += len(buf)
                    if len(buf) != length:
                        raise CorruptSegment(f"segment {seg_id}: truncated at row {row}")
                    arr = np.frombuffer(buf, np.uint8).reshape(-1, g.extent_bytes)
                    first = (off - layout.extent_offset(row, 0)) // g.extent_bytes
                    for i, extent in enumerate(arr):
                        if zlib.crc32(extent) != crcs[row * layout.n_chunks + first + i]:
                            raise CorruptSegment(f"segment {seg_id}: checksum mismatch at row {row} chunk {first + i}")
                    out[row, first - chunk_lo : first - chunk_lo + len(arr)] = arr[:, :used]
            side = self._read_side(fd, seg_id, header, layout) if "side" in header else None
        finally:
            os.close(fd)
        rows = self._rows_of_extents(torch.from_numpy(out))
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
        self.bytes_read += len(buf)
        if len(buf) != layout.side_bytes or zlib.crc32(buf) != header["side_crc32"]:
            raise CorruptSegment(f"segment {seg_id}: side data checksum mismatch")
        raw, out = np.frombuffer(buf, np.uint8), []
        for entry in header["side"]:
            tensors = {}
            for name, (dtype, shape, off) in entry.items():
                dt = getattr(torch, dtype)
                nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
                tensors[name] = torch.from_numpy(raw[off : off + nbytes].copy()).view(dt).view(shape)
            out.append(tensors)
        return out

    def read_summaries(self, seg_id: str) -> torch.Tensor:
        """Key summaries [L, m, H, 2, D] (``summary_dtype``) of a whole segment (small; read without touching KV)."""
        g = self.geometry
        header = self.read_header(seg_id)
        layout = self._layout(g, header)
        length = g.num_layers * layout.n_chunks * g.summary_bytes_per_chunk_layer
        with open(self.path(seg_id), "rb") as f:
            f.seek(layout.summary_offset)
            buf = f.read(length)
        self.bytes_read += len(buf)
        if len(buf) != length or zlib.crc32(buf) != header["summary_crc32"]:
            raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch")
        return torch.frombuffer(bytearray(buf), dtype=g.summary_dtype).view(
            g.num_layers, layout.n_chunks, g.num_kv_heads, 2, g.head_dim
        )
