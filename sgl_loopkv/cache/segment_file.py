"""The bytes of one segment file: encoding a segment, reading its header, extents, side data and
summaries from an open descriptor, every part verified by its crc32. Layout:
:mod:`sgl_loopkv.cache.layout`; files, names and sharing: :mod:`sgl_loopkv.cache.disk`."""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from sgl_loopkv.cache.cipher import MAGIC_SEALED, TAG_BYTES, SegmentCipher
from sgl_loopkv.cache.layout import MAGIC, PREAMBLE_BYTES, Block, KVGeometry, SegmentFileLayout, align_up
from sgl_loopkv.cache.packed import PackedKV, codec_of
from sgl_loopkv.cache.quant import QuantKV

try:  # the same CRC-32 (zlib's polynomial, same values), folded with PCLMUL: 19 MB 0.7 ms vs 4.7 ms
    from zlib_ng.zlib_ng import crc32
except ImportError:  # requirements/cpu.txt installs it; without it, zlib's
    from zlib import crc32


def _chunk_io():
    from sgl_loopkv.kernels import chunk_io  # built on first use (a C++ extension)

    return chunk_io.load()


READS_IN_FLIGHT = 4  # a chunk-pruned restore's reads of one gate issued together
_READERS = ThreadPoolExecutor(READS_IN_FLIGHT, thread_name_prefix="loopkv-pread")
LAYER_GROUP = 4  # rows per group when the writer names none (the default prefix gate)

# 4: grouped extents (rows in groups of "layer_group", a chunk's extents of a group adjacent).
#    Format 3 files are never found by a format 4 worker (the version is part of every name,
#    cache.address) and age out under the quota.
# 3: content-addressed names, per-chunk links, no index (shared by several workers).
# 2: extents padded to 512-byte sectors, float16 summaries next to narrower tiers, int8 tiers.
FORMAT_VERSION = 4


class CorruptSegment(Exception):
    """A stored segment is missing, truncated or fails its checksum."""


class SegmentGone(CorruptSegment):
    """A stored segment's file is no longer there (evicted by some worker): not damage."""


@dataclass(slots=True)
class SegmentRecord:
    """One stored segment. ``start`` is the position of its first token in the conversation;
    ``parent`` the chain hash of the chunk just before it (None at position 0); ``chunk_hashes`` the
    chain hash of each of its chunks (none: the segment gets no chunk links, so it is found only by
    its id); ``writer`` the process that stored it (``host:pid``)."""

    seg_id: str
    parent: str | None
    start: int
    n_chunks: int
    file_bytes: int
    extra_key: str | None = None  # SGLang's RadixKey namespace (LoRA id, ...)
    cache_salt: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    chunk_hashes: list[str] = field(default_factory=list, repr=False)
    writer: str = ""


def _to_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a CPU tensor (any dtype, bf16 included) as a uint8 array."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _file_order(rows: torch.Tensor, m: int, c: int, group: int) -> np.ndarray:
    """Extents of rows [R, 2, m * c, H, D] in file order (per group of ``group`` rows, per chunk,
    its rows; an extent = K | V of one chunk of one row) -> [R * m, extent bytes] uint8, written by
    one strided copy per group. The general path (transpose, then a numpy regroup and ``tobytes``)
    copied every byte three times on the disk writer's thread: 0.34 s of a 2K-token turn's 0.42 s
    write."""
    R, H, D = rows.shape[0], rows.shape[3], rows.shape[4]
    out = torch.empty(R * m * 2 * c * H * D, dtype=rows.dtype)
    at = 0
    for g0 in range(0, R, group):
        n = min(group, R - g0)
        block = out[at : at + n * m * 2 * c * H * D].view(m, n, 2, c, H, D)
        block.copy_(rows[g0 : g0 + n].reshape(n, 2, m, c, H, D).permute(2, 0, 1, 3, 4, 5))
        at += block.numel()
    return _to_bytes(out).reshape(R * m, -1)


@dataclass(slots=True)
class SegmentCodec:
    """Encodes and decodes segment files of one KV geometry; counts the bytes it reads. Files it
    writes group rows by ``layer_group`` (the writer's gate); it reads any grouping. With a
    ``cipher`` it writes and reads only sealed files (:mod:`sgl_loopkv.cache.cipher`): a unit's tag
    takes the place of its crc32, and a file it cannot open is a :class:`CorruptSegment`."""

    geometry: KVGeometry
    layer_group: int = LAYER_GROUP
    cipher: SegmentCipher | None = None
    bytes_read: int = field(default=0)
    reads: int = field(default=0)  # extent reads issued (cold reads cost per request here, not per byte)
    read_s: float = field(
        default=0.0
    )  # Python-side reads (:meth:`read`, :meth:`read_chunks`): preads, summed over threads
    verify_s: float = field(default=0.0)  # and their crc32s or decryption
    _crc_tables: dict = field(default_factory=dict, repr=False)

    def encode(
        self, record: SegmentRecord, kv: torch.Tensor | PackedKV, summaries: torch.Tensor, writer: str
    ) -> list[bytes | memoryview]:
        """The file's bytes, in order (preamble, header, gap, extents, summaries, side data)."""
        g = self.geometry
        m, c = record.n_chunks, g.chunk_tokens
        packed = kv if isinstance(kv, PackedKV) else None
        rows = packed.rows if packed else kv
        R = rows.shape[0]
        assert rows.shape[1:] == (2, m * c, g.num_kv_heads, g.head_dim), rows.shape
        assert isinstance(rows, QuantKV) == g.quantized, "stored rows do not match the tier's dtype"
        assert not record.chunk_hashes or len(record.chunk_hashes) == m, "one chain hash per chunk"

        def extents(t: torch.Tensor) -> np.ndarray:
            # [R, 2, m, c, H, ...] -> [R, m, 2, c, H, ...]: extent (r, j) = K | V of chunk j, contiguous
            t = t.reshape(R, 2, m, c, *t.shape[3:]).transpose(1, 2).contiguous()
            return _to_bytes(t).reshape(R * m, -1)

        G = max(1, min(self.layer_group, R))
        if not g.quantized and g.extent_bytes == c * g.token_bytes_per_layer:
            raw = _file_order(rows, m, c, G)  # float extents fill whole sectors: one strided copy
        else:
            raw = np.concatenate([extents(rows.q), extents(rows.scale)], 1) if g.quantized else extents(rows)
            pad = g.extent_bytes - raw.shape[1]
            if pad:
                raw = np.concatenate([raw, np.zeros((R * m, pad), np.uint8)], axis=1)
            raw = raw.reshape(R, m, -1)  # -> file order: per group of G rows, per chunk, its rows
            raw = np.concatenate(
                [raw[g0 : g0 + G].transpose(1, 0, 2).reshape(-1, raw.shape[2]) for g0 in range(0, R, G)]
            )
        summary_raw = _to_bytes(summaries.to(g.summary_dtype))
        per_layer = summary_raw.reshape(g.num_layers, -1)  # layer-major: a restore reads only the layers it scores
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
        if self.cipher is not None:
            return self._encode_sealed(record, writer, R, G, packed, raw, per_layer, side_raw, side_meta)
        crcs = [crc32(row) for row in raw]
        header = self._header_common(record, writer, G) | {
            "extent_crc32": crcs,
            "summary_crc32": crc32(summary_raw),
            "summary_layer_crc32": [crc32(row) for row in per_layer],
        }
        if packed:
            header |= packed.header() | {"rows": R, "side": side_meta, "side_crc32": crc32(side_raw)}
            header["side_bytes"] = len(side_raw)
        record.writer = writer
        return self._frame(MAGIC, json.dumps(header).encode(), [raw.reshape(-1).data, summary_raw.tobytes(), side_raw])

    def _header_common(self, record: SegmentRecord, writer: str, group: int) -> dict:
        return {
            "format": FORMAT_VERSION,
            "seg_id": record.seg_id,
            "parent": record.parent,
            "start": record.start,
            "n_chunks": record.n_chunks,
            "extra_key": record.extra_key,
            "cache_salt": record.cache_salt,
            "geometry": self.geometry.to_json(),
            "token_ids": record.token_ids,
            "chunk_hashes": record.chunk_hashes,
            "writer": writer,
            "layer_group": group,
        }

    @staticmethod
    def _frame(magic: bytes, hbytes: bytes, body: list) -> list[bytes | memoryview]:
        kv_offset = align_up(PREAMBLE_BYTES + len(hbytes))
        preamble = magic + struct.pack("<II", len(hbytes), crc32(hbytes))
        gap = bytes(kv_offset - PREAMBLE_BYTES - len(hbytes))
        return [preamble, hbytes, gap, *(memoryview(b).cast("B") for b in body)]

    def _encode_sealed(self, record, writer, R, G, packed, raw, per_layer, side_raw, side_meta):
        """:meth:`encode` under the cipher: units sealed in order (extents, summary layers, side data),
        their tags in the header, the header sealed (:mod:`sgl_loopkv.cache.cipher`)."""
        seal, salt, sid = self.cipher.seal, self.cipher.new_salt(), record.seg_id
        ext, tags, staged = np.empty_like(raw), [], bytearray(raw.shape[1] + TAG_BYTES)
        view = np.frombuffer(staged, np.uint8)
        for k, row in enumerate(raw):  # one staging buffer: a new ciphertext per extent tripled the write's time
            self.cipher.seal_into(sid, salt, k, row, staged)
            ext[k] = view[: raw.shape[1]]
            tags.append(bytes(staged[raw.shape[1] :]))
        E, summ = len(raw), []
        for layer, row in enumerate(per_layer):
            ct, tag = seal(sid, salt, E + layer, row)
            summ.append(ct)
            tags.append(tag)
        side_ct, side_tag = seal(sid, salt, E + len(per_layer), side_raw)
        tags.append(side_tag)
        header = self._header_common(record, writer, G) | {
            "cipher": "aes-256-gcm",
            "salt": salt.hex(),
            "tags": base64.b64encode(b"".join(tags)).decode(),
        }
        if packed:
            header |= packed.header() | {"rows": R, "side": side_meta, "side_bytes": len(side_raw)}
        record.writer = writer
        hbytes = self.cipher.seal_header(json.dumps(header).encode())
        return self._frame(MAGIC_SEALED, hbytes, [ext.reshape(-1).data, b"".join(summ), side_ct])

    def _open_extents(self, header: dict, k0: int, src: memoryview, dst: memoryview, got: int, n: int) -> np.ndarray:
        """Decrypt the first ``got`` of ``n`` sealed extents (units ``k0 ...``) from ``src`` into ``dst``
        -> ok [n]. One staging buffer for ciphertext | tag (AES-GCM wants them adjacent; the tags are in
        the header): a new one per extent cost as much as the decryption."""
        eb, tags, sid, salt = self.geometry.extent_bytes, header["_tags"], header["seg_id"], header["_salt"]
        sealed = bytearray(eb + TAG_BYTES)
        staged, open_into, ok = memoryview(sealed), self.cipher.open_into, np.zeros(n, bool)
        for i in range(got):
            staged[:eb] = src[i * eb : (i + 1) * eb]
            staged[eb:] = tags[(k0 + i) * TAG_BYTES : (k0 + i + 1) * TAG_BYTES]
            ok[i] = open_into(sid, salt, k0 + i, sealed, dst[i * eb : (i + 1) * eb])
        return ok

    def _unit_ok(self, header: dict, unit: int, data, crc: int | None, out=None) -> bool:
        """Is unit ``unit`` (``data``, its stored bytes) intact? Plain: its crc32 is ``crc``. Sealed:
        it decrypts under its tag, into ``out`` (a writable buffer of its length)."""
        if self.cipher is None:
            return crc32(data) == crc
        sealed = bytearray(len(data) + TAG_BYTES)
        sealed[: len(data)] = data
        sealed[len(data) :] = header["_tags"][unit * TAG_BYTES : (unit + 1) * TAG_BYTES]
        return self.cipher.open_into(header["seg_id"], header["_salt"], unit, sealed, out)

    def header(self, fd: int, seg_id: str) -> dict:
        """The verified header of an open segment file (``kv_offset`` added; a sealed file's salt and
        tags decoded as ``_salt``, ``_tags``)."""
        magic = MAGIC if self.cipher is None else MAGIC_SEALED
        try:
            pre = os.pread(fd, PREAMBLE_BYTES, 0)
            if len(pre) != PREAMBLE_BYTES or pre[:8] != magic:
                sealed = "sealed" if pre[:8] == MAGIC_SEALED else "plain" if pre[:8] == MAGIC else "unknown"
                raise CorruptSegment(
                    f"segment {seg_id}: bad preamble (a {sealed} file, this tier reads only "
                    f"{'plain' if self.cipher is None else 'sealed'} ones)"
                )
            hlen, hcrc = struct.unpack("<II", pre[8:])
            hbytes = os.pread(fd, hlen, PREAMBLE_BYTES)
        except OSError as e:
            raise CorruptSegment(f"segment {seg_id}: {e}") from e
        if len(hbytes) != hlen or crc32(hbytes) != hcrc:
            raise CorruptSegment(f"segment {seg_id}: header checksum mismatch")
        plain = hbytes if self.cipher is None else self.cipher.open_header(hbytes)
        if plain is None:
            raise CorruptSegment(f"segment {seg_id}: header does not decrypt with this key (another key, or tampered)")
        try:
            header = json.loads(plain)
            if self.cipher is not None:
                header["_salt"], header["_tags"] = bytes.fromhex(header["salt"]), base64.b64decode(header["tags"])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptSegment(f"segment {seg_id}: unreadable header ({type(e).__name__})") from e
        if (
            not isinstance(header, dict)
            or header.get("format") != FORMAT_VERSION
            or header.get("geometry") != self.geometry.to_json()
        ):
            raise CorruptSegment(f"segment {seg_id}: another format or KV geometry")
        if self.cipher is not None and not seg_id.startswith("chunk ") and header.get("seg_id") != seg_id:
            # a whole sealed file copied over another name: intact under the key, but another history's KV
            raise CorruptSegment(f"segment {seg_id}: its sealed header names another segment")
        header["kv_offset"] = align_up(PREAMBLE_BYTES + hlen)
        return header

    def layout(self, header: dict) -> SegmentFileLayout:
        return SegmentFileLayout(
            self.geometry,
            header["n_chunks"],
            header["kv_offset"],
            header.get("rows"),
            header.get("side_bytes", 0),
            header["layer_group"],
        )

    def _fetch(
        self,
        fd: int,
        layout: SegmentFileLayout,
        header: dict,
        blocks: list[Block],
        parallel: bool,
        into: list[np.ndarray] | None = None,
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Each block's extents -> ([n_chunks, rows, extent bytes], ok [n_chunks, rows]: read whole and
        crc32 verified, or decrypted under its tag), one block at a time (used while its buffer is still in the CPU cache).
        ``parallel``: the reads in flight together (scattered runs are latency-bound on a cold
        file; pread drops the GIL). ``into``: per block, the contiguous uint8 array [n_chunks, rows,
        extent bytes] to read into (``preadv``: the kernel's copy is the only one), yielded back."""
        eb, crcs = self.geometry.extent_bytes, header.get("extent_crc32")

        def pread(i: int) -> bytes | np.ndarray:
            b, t0 = blocks[i], time.perf_counter()
            if into is None:
                buf = os.pread(fd, b.length(eb), b.offset)
            else:
                buf = into[i].reshape(-1)[: os.preadv(fd, [into[i]], b.offset)]
            self.read_s += time.perf_counter() - t0
            return buf

        order = range(len(blocks))
        bufs = _READERS.map(pread, order) if parallel and len(blocks) > 1 else map(pread, order)
        for i_block, (b, buf) in enumerate(zip(blocks, bufs)):
            self.bytes_read += len(buf)
            self.reads += 1
            n = b.n_chunks * (b.row1 - b.row0)
            got, mv, k0 = len(buf) // eb, memoryview(buf), (b.offset - layout.kv_offset) // eb
            t0 = time.perf_counter()
            if self.cipher is None:
                ok = np.array([i < got and crc32(mv[i * eb : (i + 1) * eb]) == crcs[k0 + i] for i in range(n)])
            else:  # decrypted in place (a read into ``into``) or into a new buffer (``buf`` is bytes)
                buf = buf if into is not None else np.empty(got * eb, np.uint8)
                ok = self._open_extents(header, k0, mv, memoryview(buf).cast("B"), min(got, n), n)
            self.verify_s += time.perf_counter() - t0
            shape = (b.n_chunks, b.row1 - b.row0)
            if into is not None:  # read in place: a short read's missing extents are not ok (the caller zeroes them)
                yield into[i_block], ok.reshape(shape)
                continue
            arr = np.frombuffer(buf, np.uint8, got * eb).reshape(got, eb)  # a view: no copy of a whole read
            if got < n:  # cut short: the missing extents zero (and not ok)
                arr = np.concatenate([arr, np.zeros((n - got, eb), np.uint8)])
            yield arr.reshape(*shape, eb), ok.reshape(shape)

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
            for b, (arr, ok) in zip(blocks, self._fetch(fd, layout, header, blocks, parallel=False)):
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
        int8). Each group's extents are read (``preadv``) into one buffer in file order, [n, group
        rows, extent bytes], and copied once from there into the rows' layout: no intermediate
        ``bytes`` per read and no second copy (a cold 4K-token resume spent more time building its
        tensors than reading). Raises CorruptSegment."""
        g = self.geometry
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
        for b, (_, ok) in zip(blocks, self._fetch(fd, layout, header, blocks, parallel=False, into=into)):
            if not ok.all():
                bad = b.row0 + int(np.nonzero(~ok)[1][0])
                raise CorruptSegment(f"segment {seg_id}: truncated or checksum mismatch at row {bad}")
        if g.quantized:
            q = torch.empty((R, 2, n * c, H, D), dtype=torch.int8)
            scale = torch.empty((R, 2, n * c, H), dtype=torch.float32)
            qb = 2 * c * H * D
            for g0, buf in groups:
                raw, gr = torch.from_numpy(buf), buf.shape[1]
                q[g0 : g0 + gr].view(gr, 2, n, c, H, D).copy_(
                    raw[..., :qb].view(torch.int8).view(n, gr, 2, c, H, D).permute(1, 2, 0, 3, 4, 5)
                )
                scale[g0 : g0 + gr].view(gr, 2, n, c, H).copy_(
                    raw[..., qb:used].view(torch.float32).view(n, gr, 2, c, H).permute(1, 2, 0, 3, 4)
                )
            return QuantKV(q, scale)
        out = torch.empty((R, 2, n * c, H, D), dtype=g.dtype)
        for g0, buf in groups:
            raw, gr = torch.from_numpy(buf), buf.shape[1]
            out[g0 : g0 + gr].view(gr, 2, n, c, H, D).copy_(
                raw[..., :used].view(g.dtype).view(n, gr, 2, c, H, D).permute(1, 2, 0, 3, 4, 5)
            )
        return out

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

    def read_chunks(
        self, fd: int, seg_id: str, header: dict, rows: range, chunks: list[int]
    ) -> tuple[torch.Tensor | QuantKV, list[list[int]]]:
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
        for b, (arr, ok) in zip(blocks, self._fetch(fd, layout, header, blocks, parallel=True, into=into)):
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
            return self._rows_of_extents(raw.transpose(0, 1)), bad
        c, H, D = g.chunk_tokens, g.num_kv_heads, g.head_dim
        return raw.view(g.dtype).view(len(chunks), R, 2, c, H, D).permute(1, 2, 0, 3, 4, 5), bad

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
        r = torch.arange(rows.start, rows.stop)
        g0 = r - r % layout.group
        width = torch.clamp(g0 + layout.group, max=layout.rows) - g0
        j = torch.tensor(chunks)[:, None]
        index = g0 * layout.n_chunks + j * width + r - g0  # [n, R]: each extent's crc32 index
        k_base = torch.tensor([b.data_ptr() for b in k_rows])
        v_base = torch.tensor([b.data_ptr() for b in v_rows])
        at = pages.to(torch.int64)[:, None] * half
        targets = torch.stack((k_base + at, v_base + at), dim=-1).reshape(-1, 2)
        crcs = self._crc_table(header)[index.flatten()]
        table = torch.tensor([[b.offset, b.n_chunks * R] for b in blocks], dtype=torch.int64)
        ok, nbytes = native.read_extents(fd, table, targets, crcs, half, g.extent_bytes)
        self.bytes_read += nbytes
        self.reads += len(blocks)
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
        self.bytes_read += len(buf)
        plain = bytearray(len(buf)) if self.cipher is not None else None
        unit = layout.rows * layout.n_chunks + self.geometry.num_layers  # after the extents and summary layers
        if len(buf) != layout.side_bytes or not self._unit_ok(header, unit, buf, header.get("side_crc32"), plain):
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
        the given layers only (small; read without touching KV). Each layer's block is verified by its
        own crc32 (files written before per-layer checksums: the whole block is read and verified)."""
        g = self.geometry
        header = header or self.header(fd, seg_id)
        layout = self.layout(header)
        block = layout.n_chunks * g.summary_bytes_per_chunk_layer
        crcs = header.get("summary_layer_crc32")
        if self.cipher is not None:  # sealed per layer: all layers are every layer's block
            return self._sealed_summaries(fd, seg_id, header, layout, range(g.num_layers) if layers is None else layers)
        if layers is None or crcs is None:
            buf = os.pread(fd, g.num_layers * block, layout.summary_offset)
            self.bytes_read += len(buf)
            if len(buf) != g.num_layers * block or crc32(buf) != header["summary_crc32"]:
                raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch")
            out = self._summaries(buf, g.num_layers, layout.n_chunks)
            return out if layers is None else out[layers].clone()
        parts = []
        for layer in layers:  # the scored layers' blocks lie a period apart: in flight together, then read
            os.posix_fadvise(fd, layout.summary_offset + layer * block, block, os.POSIX_FADV_WILLNEED)
        for layer in layers:
            buf = os.pread(fd, block, layout.summary_offset + layer * block)
            self.bytes_read += len(buf)
            if len(buf) != block or crc32(buf) != crcs[layer]:
                raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch at layer {layer}")
            parts.append(buf)
        return self._summaries(b"".join(parts), len(layers), layout.n_chunks)

    def _sealed_summaries(self, fd: int, seg_id: str, header: dict, layout: SegmentFileLayout, layers) -> torch.Tensor:
        block = layout.n_chunks * self.geometry.summary_bytes_per_chunk_layer
        E, plain = layout.rows * layout.n_chunks, bytearray(len(layers) * block)
        for i, layer in enumerate(layers):
            buf = os.pread(fd, block, layout.summary_offset + layer * block)
            self.bytes_read += len(buf)
            out = memoryview(plain)[i * block : (i + 1) * block]
            if len(buf) != block or not self._unit_ok(header, E + layer, buf, None, out):
                raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch at layer {layer}")
        return self._summaries(bytes(plain), len(layers), layout.n_chunks)

    def _summaries(self, buf: bytes, n_layers: int, n_chunks: int) -> torch.Tensor:
        g = self.geometry
        shape = (n_layers, n_chunks, g.num_kv_heads, 2, g.head_dim)
        if not buf:  # no layer asked for (a restore that scores nothing)
            return torch.empty(shape, dtype=g.summary_dtype)
        return torch.frombuffer(bytearray(buf), dtype=g.summary_dtype).view(shape)
