"""Disk tier: content-addressed segment files in a directory shared by every worker of a cluster,
under one byte quota, crash-safe and checksummed.

Directory (one per model and KV geometry, ``cache.backend.model_fingerprint``)::

    seg_<start chunk>-<chain hash of its last chunk>.kv   a segment: chunks [s, e) of one history
    chunks/<chain hash of chunk j>                        a hard link to a segment holding chunk j
    <host>.<pid>.<rand>.<bytes>.tmp                       a segment being written (space reserved)
    evict.lock, lock                                      flock files (``cache.disk_dir``)

Names come from the hash chain of :mod:`sgl_loopkv.cache.address`, so the same history stored by
two workers is the same name. Publishing is ``link(tmp, name)``: atomic, and a second writer of a
name that exists is a no-op (its temp file is dropped). Files never change once published; the
one mutable attribute is the mtime, bumped on every use, which is the cluster-wide LRU signal that
eviction reads.

**Lookup by chunk, not by segment.** Workers cut histories into segments differently (A stores
``[0, 4)`` and ``[4, 8)`` in two turns; B, which saw only the second turn, ``[0, 8)``), so a name
per segment could not be found from another worker's boundaries. Every stored chunk therefore also
gets a name of its own, ``chunks/<h[j]>``: a hard link (no bytes, one directory entry) to the
first segment published with that chunk. A worker that has a prompt's first ``p`` chunks opens
``chunks/<h[p]>``, reads that file's small header (which lists its chunks' hashes), uses the run
of chunks that match the prompt, and continues after it: one ``open`` per stored segment
crossed, never a directory scan per request. A chunk whose link points to an evicted segment is
found again once any worker stores it anew.

**A write in flight.** Turns end and the next one may arrive at another worker before the segment
of the first is on disk (the write-through is asynchronous). So a worker that queues a segment
first *announces* it: ``chunks/<h[s]>.pending`` (empty) for its first chunk, removed when the
segment is published (or failed). A lookup that misses a chunk whose announcement exists waits for
it, up to :data:`PENDING_WAIT_S`, instead of recomputing what is being written right now.

Every extent (one chunk of one layer) and the header carry a crc32; a read that finds a missing
(:class:`SegmentGone`: evicted by some worker), truncated or corrupt file raises
:class:`CorruptSegment` and the caller recomputes that part of the history instead of serving it.
A write that fails (a full disk: ``OSError``) leaves nothing behind. Layout of one file:
:mod:`sgl_loopkv.cache.layout`.

Format 2 (one server per directory, ``index.json`` + ``seg_<uuid>.kv``) is not shareable: its
files are dropped at start-up, with a warning (those conversations are recomputed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sgl_loopkv.cache.disk_dir import SEG_PREFIX, SEG_SUFFIX, SharedDirectory, pid_alive
from sgl_loopkv.cache.layout import MAGIC, PREAMBLE_BYTES, KVGeometry, SegmentFileLayout, align_up
from sgl_loopkv.cache.packed import PackedKV, codec_of
from sgl_loopkv.cache.quant import QuantKV

logger = logging.getLogger(__name__)

# 3: content-addressed names, per-chunk links, no index (shared by several workers).
# 2: extents padded to 512-byte sectors, float16 summaries next to narrower tiers, int8 tiers.
FORMAT_VERSION = 3
LEGACY_INDEX = "index.json"
CHUNKS = "chunks"
PENDING = ".pending"
PENDING_WAIT_S = 2.0  # the longest a lookup waits for an announced segment (one turn's write: ~0.1 s)
PENDING_STALE_S = 60.0  # an announcement this old belongs to a writer that died

# Segment ids are minted by the cache (address.segment_id), never taken from a request; path()
# refuses anything else, and so does a header naming another id, so no path can leave the directory.
SEG_ID = re.compile(r"[0-9A-Za-z_-]{1,80}")
CHUNK_HASH = re.compile(r"[0-9a-f]{32}")


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


@dataclass(frozen=True, slots=True)
class Found:
    """A stored run of a history: chunks ``[lo, hi)`` of ``record``'s segment are the asked chunks
    ``[first, first + hi - lo)`` of the history."""

    record: SegmentRecord
    lo: int
    hi: int


def _to_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a CPU tensor (any dtype, bf16 included) as a uint8 array."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskSegmentStore:
    """Segment files in ``root``, shared with other workers; never more than ``quota_bytes`` of
    them in all (published and being written, whoever writes)."""

    def __init__(self, root: Path, quota_bytes: int, geometry: KVGeometry):
        self.root, self.quota_bytes, self.geometry = Path(root), quota_bytes, geometry
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / CHUNKS).mkdir(mode=0o700, exist_ok=True)
        self.dir = SharedDirectory(self.root)
        self.writer = f"{socket.gethostname()}:{os.getpid()}"
        self.bytes_read = 0
        self.bytes_written = 0
        with self.dir.eviction_lock():
            self._drop_legacy()
            self.dir.remove_stale_tmp()
            self._remove_dangling_links()
            self.used_bytes = self.dir.scan().total  # as of the latest scan (every write rescans)

    # --- start-up ------------------------------------------------------------------------------
    def _drop_legacy(self) -> None:
        index = self.root / LEGACY_INDEX
        if not index.exists():
            return
        try:
            names = list(json.loads(index.read_text()).get("segments", {}))
        except (ValueError, AttributeError):
            names = []
        old = [self.root / f"seg_{n}.kv" for n in names if SEG_ID.fullmatch(n)]
        logger.warning(
            "loopkv: %s holds a format-2 disk tier (one server, index.json): not shareable by format %d, so its "
            "%d segments are dropped (those conversations are recomputed once)",
            self.root,
            FORMAT_VERSION,
            len(old),
        )
        for f in old:
            f.unlink(missing_ok=True)
        index.unlink(missing_ok=True)

    def _remove_dangling_links(self) -> None:
        """Chunk links whose segment is gone (a crash mid-eviction): they would keep its bytes alive;
        announcements of writes that never finished."""
        with os.scandir(self.root / CHUNKS) as it:
            for e in it:
                try:
                    st = e.stat()
                    if e.name.endswith(PENDING):
                        host, _, pid = Path(e.path).read_text().partition(" ")
                        dead = host == self.dir.host and pid.isdigit() and not pid_alive(int(pid))
                        if dead or time.time() - st.st_mtime > PENDING_STALE_S:
                            os.unlink(e.path)
                    elif st.st_nlink == 1:
                        os.unlink(e.path)
                except FileNotFoundError:
                    continue

    # --- names ---------------------------------------------------------------------------------
    def path(self, seg_id: str) -> Path:
        if not SEG_ID.fullmatch(seg_id):
            raise ValueError(f"not a segment id: {seg_id!r}")
        return self.root / f"{SEG_PREFIX}{seg_id}{SEG_SUFFIX}"

    def _chunk_path(self, chunk_hash: str, suffix: str = "") -> Path:
        if not CHUNK_HASH.fullmatch(chunk_hash):
            raise ValueError(f"not a chunk hash: {chunk_hash!r}")
        return self.root / CHUNKS / (chunk_hash + suffix)

    def announce(self, record: SegmentRecord) -> None:
        """A write of ``record`` is queued: a lookup of its first chunk waits for it (see the module doc)."""
        if record.chunk_hashes:
            with contextlib.suppress(OSError):  # only an optimisation: a miss recomputes
                fd = os.open(self._chunk_path(record.chunk_hashes[0], PENDING), os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    os.write(fd, f"{self.dir.host} {os.getpid()}".encode())  # whose: a dead writer's goes at start-up
                finally:
                    os.close(fd)

    def unannounce(self, record: SegmentRecord) -> None:
        """The announced write will not happen (or is done): lookups stop waiting for it."""
        if record.chunk_hashes:
            self._chunk_path(record.chunk_hashes[0], PENDING).unlink(missing_ok=True)

    # --- write -------------------------------------------------------------------------------
    def file_bytes(self, n_chunks: int, n_tokens_ids: int) -> int:
        """Upper bound of a segment file's size before it is written (header estimate included)."""
        header = 4096 + 16 * n_tokens_ids + (24 * self.geometry.num_layers + 40) * n_chunks
        return SegmentFileLayout(self.geometry, n_chunks, align_up(PREAMBLE_BYTES + header)).file_bytes

    def write(self, record: SegmentRecord, kv: torch.Tensor | PackedKV, summaries: torch.Tensor) -> list[str]:
        """Store ``kv`` ([L, 2, T, H, D] with T = n_chunks * chunk, or a PackedKV whose rows have
        that shape) and ``summaries`` [L, m, H, 2, D], evicting least recently used segments (any
        worker's) to stay under the quota. Returns the ids it evicted. A segment already published
        (by any worker) is not written again. Raises :class:`NoRoom` when the quota cannot hold it,
        ``OSError`` when the disk refuses it."""
        try:
            return self._write(record, kv, summaries)
        finally:
            self.unannounce(record)

    def _write(self, record: SegmentRecord, kv: torch.Tensor | PackedKV, summaries: torch.Tensor) -> list[str]:
        parts = self._encode(record, kv, summaries)
        size = sum(len(p) for p in parts)
        final = self.path(record.seg_id)
        with self.dir.eviction_lock():
            if final.exists():  # published by another worker (or by us before a restart)
                record.file_bytes = final.stat().st_size
                self.touch([record.seg_id])
                return []
            evicted = self._evict_for(size, keep=record.seg_id)
            tmp = self.dir.tmp_path(size)  # the name reserves the space for every other worker's scan
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0o600 whatever the umask
        try:
            with open(fd, "wb") as f:
                for p in parts:
                    f.write(p)
                f.flush()
                os.fsync(f.fileno())
            with self.dir.eviction_lock():  # no eviction between the name and its chunk links
                try:
                    os.link(tmp, final)
                except FileExistsError:  # the same history, published meanwhile: a no-op
                    pass
                for h in record.chunk_hashes:
                    try:
                        os.link(final, self._chunk_path(h))
                    except FileExistsError:  # the chunk is already findable through another segment
                        pass
        finally:
            tmp.unlink(missing_ok=True)  # a half-written file would hold the space a full disk lacks
        _fsync_dir(self.root)
        record.file_bytes = size
        self.bytes_written += size
        self.used_bytes += size
        return evicted

    def _evict_for(self, nbytes: int, keep: str) -> list[str]:
        """Under the eviction lock: delete least recently used segments until ``nbytes`` more fit."""
        if nbytes > self.quota_bytes:
            raise NoRoom(f"a segment of {nbytes} B does not fit the disk quota of {self.quota_bytes} B")
        usage = self.dir.scan()
        used, evicted = usage.total, []
        for victim in sorted(usage.published, key=lambda f: f.eviction_order):
            if used + nbytes <= self.quota_bytes:
                break
            if victim.seg_id == keep or not SEG_ID.fullmatch(victim.seg_id):
                continue
            self._unlink(victim.seg_id)
            used -= victim.nbytes
            evicted.append(victim.seg_id)
        self.used_bytes = used
        if used + nbytes > self.quota_bytes:
            raise NoRoom(f"{used} B of segments in use leave no room for {nbytes} B under {self.quota_bytes} B")
        return evicted

    def _encode(self, record: SegmentRecord, kv: torch.Tensor | PackedKV, summaries: torch.Tensor) -> list[bytes]:
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
            "format": FORMAT_VERSION,
            "seg_id": record.seg_id,
            "parent": record.parent,
            "start": record.start,
            "n_chunks": m,
            "extra_key": record.extra_key,
            "cache_salt": record.cache_salt,
            "geometry": g.to_json(),
            "token_ids": record.token_ids,
            "chunk_hashes": record.chunk_hashes,
            "writer": self.writer,
            "extent_crc32": crcs,
            "summary_crc32": zlib.crc32(summary_raw),
        }
        if packed:
            header |= packed.header() | {"rows": R, "side": side_meta, "side_crc32": zlib.crc32(side_raw)}
            header["side_bytes"] = len(side_raw)
        record.writer = self.writer
        hbytes = json.dumps(header).encode()
        kv_offset = align_up(PREAMBLE_BYTES + len(hbytes))
        preamble = MAGIC + struct.pack("<II", len(hbytes), zlib.crc32(hbytes))
        gap = bytes(kv_offset - PREAMBLE_BYTES - len(hbytes))
        return [preamble, hbytes, gap, raw.tobytes(), summary_raw.tobytes(), side_raw.tobytes()]

    # --- delete --------------------------------------------------------------------------------
    def delete(self, seg_id: str) -> None:
        """Remove a segment and the chunk links that point to it (under the eviction lock)."""
        with self.dir.eviction_lock():
            self._unlink(seg_id)

    def _unlink(self, seg_id: str) -> None:
        """Links first, the name last: a crash in between leaves a findable-by-name segment, never a
        link keeping bytes of a segment that is gone (those are removed at start-up anyway)."""
        path = self.path(seg_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            ino = os.fstat(fd)
            try:
                hashes = self._header(fd, seg_id).get("chunk_hashes", [])
            except CorruptSegment:
                hashes = []  # a damaged header: its links, if any, go at the next start-up
            for h in hashes:
                link = self._chunk_path(h) if isinstance(h, str) and CHUNK_HASH.fullmatch(h) else None
                with contextlib.suppress(FileNotFoundError):  # removed by another worker meanwhile
                    if link is not None and os.path.samestat(os.stat(link), ino):
                        os.unlink(link)
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        self.used_bytes = max(self.used_bytes - ino.st_size, 0)

    def touch(self, seg_ids) -> None:
        """A use of these segments: their mtime is what eviction orders by, for every worker."""
        for seg_id in seg_ids:
            with contextlib.suppress(FileNotFoundError):  # removed by another worker meanwhile
                os.utime(self.path(seg_id))

    # --- find ----------------------------------------------------------------------------------
    def find(self, chain: list[str], first: int, wait_s: float = PENDING_WAIT_S) -> Found | None:
        """The stored segment holding chunk ``first`` of the history whose chain hashes are
        ``chain``, and how many of the following chunks it holds too (one ``open``). None when no
        worker stored that chunk (or its segment was evicted); a chunk announced by a writer is
        waited for, up to ``wait_s``."""
        link = self._chunk_path(chain[first])
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(link, os.O_RDONLY)
                break
            except FileNotFoundError:
                pending = self._chunk_path(chain[first], PENDING)
                try:
                    fresh = time.time() - pending.stat().st_mtime < PENDING_STALE_S
                except FileNotFoundError:
                    fresh = False
                if not fresh or time.monotonic() > deadline:
                    return None
                time.sleep(0.005)
        try:
            header = self._header(fd, "chunk " + chain[first])
        except CorruptSegment as e:
            logger.warning("loopkv: %s", e)
            return None
        finally:
            os.close(fd)
        hashes, c = header.get("chunk_hashes") or [], self.geometry.chunk_tokens
        try:
            lo = hashes.index(chain[first])
        except ValueError:
            return None
        hi = lo
        while hi < len(hashes) and first + hi - lo < len(chain) and hashes[hi] == chain[first + hi - lo]:
            hi += 1
        if not SEG_ID.fullmatch(str(header.get("seg_id"))) or header["start"] != (first - lo) * c:
            return None  # a header that disagrees with its own chain: not trusted
        record = SegmentRecord(
            seg_id=header["seg_id"],
            parent=header.get("parent"),
            start=header["start"],
            n_chunks=header["n_chunks"],
            file_bytes=0,
            extra_key=header.get("extra_key"),
            cache_salt=header.get("cache_salt"),
            token_ids=header["token_ids"],
            chunk_hashes=hashes,
            writer=header.get("writer", ""),
        )
        return Found(record, lo, hi)

    # --- read --------------------------------------------------------------------------------
    def _open(self, seg_id: str) -> int:
        try:
            return os.open(self.path(seg_id), os.O_RDONLY)
        except FileNotFoundError as e:
            raise SegmentGone(f"segment {seg_id} is no longer on disk (evicted)") from e
        except OSError as e:
            raise CorruptSegment(f"segment {seg_id}: {e}") from e

    def _header(self, fd: int, seg_id: str) -> dict:
        try:
            pre = os.pread(fd, PREAMBLE_BYTES, 0)
            if len(pre) != PREAMBLE_BYTES or pre[:8] != MAGIC:
                raise CorruptSegment(f"segment {seg_id}: bad preamble")
            hlen, hcrc = struct.unpack("<II", pre[8:])
            hbytes = os.pread(fd, hlen, PREAMBLE_BYTES)
        except OSError as e:
            raise CorruptSegment(f"segment {seg_id}: {e}") from e
        if len(hbytes) != hlen or zlib.crc32(hbytes) != hcrc:
            raise CorruptSegment(f"segment {seg_id}: header checksum mismatch")
        header = json.loads(hbytes)
        if header.get("format") != FORMAT_VERSION or header.get("geometry") != self.geometry.to_json():
            raise CorruptSegment(f"segment {seg_id}: another format or KV geometry")
        header["kv_offset"] = align_up(PREAMBLE_BYTES + hlen)
        return header

    def read_header(self, seg_id: str) -> dict:
        fd = self._open(seg_id)
        try:
            return self._header(fd, seg_id)
        finally:
            os.close(fd)

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
        PackedKV (one read per stored row, its side data verified too). The file is opened once: a
        worker evicting it meanwhile cannot take it away. Raises CorruptSegment."""
        g = self.geometry
        fd = self._open(seg_id)
        try:
            header = self._header(fd, seg_id)
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
        fd = self._open(seg_id)
        try:
            header = self._header(fd, seg_id)
            layout = self._layout(g, header)
            length = g.num_layers * layout.n_chunks * g.summary_bytes_per_chunk_layer
            buf = os.pread(fd, length, layout.summary_offset)
        finally:
            os.close(fd)
        self.bytes_read += len(buf)
        if len(buf) != length or zlib.crc32(buf) != header["summary_crc32"]:
            raise CorruptSegment(f"segment {seg_id}: summary checksum mismatch")
        return torch.frombuffer(bytearray(buf), dtype=g.summary_dtype).view(
            g.num_layers, layout.n_chunks, g.num_kv_heads, 2, g.head_dim
        )


class NoRoom(Exception):
    """The quota cannot hold a new segment (everything else is in use or it is too big alone)."""
