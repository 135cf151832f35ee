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
first *announces* it: ``chunks/<h[j]>.pending`` for each of its chunks (one small file naming the
writer and the segment's tokens, hard-linked under every name), removed when the segment is
published (or failed). A lookup that misses a chunk whose announcement exists waits for
it, up to :data:`PENDING_WAIT_S` (more for a long segment), instead of recomputing what is being
written right now. The server's scheduler does not wait in the lookup: it holds that request back
and serves the others meanwhile (:mod:`sgl_loopkv.cache.awaited`).

Every extent (one chunk of one layer) and the header carry a crc32; a read that finds a missing
(:class:`SegmentGone`: evicted by some worker), truncated or corrupt file raises
:class:`CorruptSegment` and the caller recomputes that part of the history instead of serving it.
A write that fails (a full disk: ``OSError``) leaves nothing behind. Layout of one file:
:mod:`sgl_loopkv.cache.layout`.

With ``--loopkv-lifecycle-disk-key-file`` every file is sealed (AES-256-GCM per extent, summary layer and
header: :mod:`sgl_loopkv.cache.cipher`), in a directory of its own per key (``cache.backend``); a
unit that does not decrypt is a :class:`CorruptSegment` like a failed crc32.

Format 2 (one server per directory, ``index.json`` + ``seg_<uuid>.kv``) is not shareable: its
files are dropped at start-up, with a warning (those conversations are recomputed).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk_announce import PENDING_WAIT_S, Announced, Announcements
from sgl_loopkv.cache.disk_dir import Presence, SharedDirectory
from sgl_loopkv.cache.disk_evict import SegmentEviction, fsync_dir
from sgl_loopkv.cache.disk_names import CHUNKS, SEG_ID, DiskNames
from sgl_loopkv.cache.layout import PREAMBLE_BYTES, KVGeometry, SegmentFileLayout, align_up
from sgl_loopkv.cache.packed import PackedKV
from sgl_loopkv.cache.read_buffers import ReadBuffers
from sgl_loopkv.cache.segment_file import ChunkRead, SegmentCodec
from sgl_loopkv.cache.segment_reads import PreadPool
from sgl_loopkv.cache.segment_record import FORMAT_VERSION, LAYER_GROUP, CorruptSegment, SegmentGone, SegmentRecord

logger = logging.getLogger(__name__)

LEGACY_INDEX = "index.json"

#: Bytes per ``write`` of a segment file. On this VM's kernel (6.18, ext4 on virtio) one write of a
#: 94 MB segment cost 240 ms of kernel time, the same bytes in 1 MB writes 27 ms (4 MB: 240 ms again):
#: that CPU is taken from the next request's prefill.
WRITE_PIECE = 1 << 20


@dataclass(frozen=True, slots=True)
class Found:
    """A stored run of a history: chunks ``[lo, hi)`` of ``record``'s segment are the asked chunks
    ``[first, first + hi - lo)`` of the history."""

    record: SegmentRecord
    lo: int
    hi: int


class OpenSegment(NamedTuple):
    """A segment held open for reads of a few chunks at a time (:meth:`DiskSegmentStore.open_for_chunks`)."""

    fd: int
    header: dict


class ReadSeconds(NamedTuple):
    """Seconds in a codec's reads so far, summed over threads."""

    preads: float
    checksums: float  # crc32s or decryption


class DiskSegmentStore:
    """Segment files in ``root``, shared with other workers; never more than ``quota_bytes`` of
    them in all (published and being written, whoever writes). With a ``cipher`` every file is
    written sealed and only sealed files are read (:mod:`sgl_loopkv.cache.cipher`). ``readers``: the
    pool of its parallel reads, given by its owner (an I/O controller) or its own."""

    def __init__(
        self,
        root: Path,
        quota_bytes: int,
        geometry: KVGeometry,
        layer_group: int = LAYER_GROUP,
        cipher: SegmentCipher | None = None,
        readers: PreadPool | None = None,
        buffers: ReadBuffers | None = None,
    ):
        """``buffers``: where whole reads' rows go (the tier store's, shared with its stores' gathers)."""
        self.root, self.quota_bytes, self.geometry = Path(root), quota_bytes, geometry
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / CHUNKS).mkdir(mode=0o700, exist_ok=True)
        self.dir = SharedDirectory(self.root)
        self.names = DiskNames(self.root)
        self.presence = Presence(self.root)  # other workers on this directory (their lookups may wait for our writes)
        self.writer = f"{socket.gethostname()}:{os.getpid()}"
        # files grouped by the writer's prefix period
        self.codec = SegmentCodec(
            geometry, layer_group, cipher, readers=readers or PreadPool(), buffers=buffers or ReadBuffers()
        )
        self.announcements = Announcements(self.names, self.dir.host)
        self.eviction = SegmentEviction(self.dir, self.names, self.codec.header)
        self.bytes_written = 0
        with self.dir.eviction_lock():
            self._drop_legacy()
            self.dir.remove_stale_tmp()
            self.eviction.remove_dangling_links(self.announcements)
            self.eviction.used_bytes = self.dir.scan().total  # as of the latest scan (every write rescans)

    def close(self) -> None:
        """Stop the codec's read threads (a later read starts them again)."""
        self.codec.close()

    @property
    def used_bytes(self) -> int:
        """Bytes of segments in the directory (any worker's), as of the latest scan."""
        return self.eviction.used_bytes

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

    # --- names ---------------------------------------------------------------------------------
    def path(self, seg_id: str) -> Path:
        return self.names.segment(seg_id)

    def announce(self, record: SegmentRecord) -> None:
        """A write of ``record`` is queued: a lookup of any of its chunks waits for it
        (:meth:`Announcements.announce`)."""
        self.announcements.announce(record)

    def unannounce(self, record: SegmentRecord) -> None:
        """The announced write will not happen (or is done): lookups stop waiting for it
        (:meth:`Announcements.unannounce`)."""
        self.announcements.unannounce(record)

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
        parts = self.codec.encode(record, kv, summaries, self.writer)
        size = sum(len(p) for p in parts)
        final = self.path(record.seg_id)
        with self.dir.eviction_lock():
            if final.exists():  # published by another worker (or by us before a restart)
                record.file_bytes = final.stat().st_size
                self.touch([record.seg_id])
                return []
            evicted = self.eviction.make_room(size, self.quota_bytes, keep=record.seg_id)
            tmp = self.dir.tmp_path(size)  # the name reserves the space for every other worker's scan
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0o600 whatever the umask
        try:
            with open(fd, "wb") as f:
                for p in parts:
                    view = memoryview(p).cast("B")
                    for i in range(0, len(view), WRITE_PIECE):  # a larger piece goes to the kernel whole
                        f.write(view[i : i + WRITE_PIECE])
                f.flush()
                os.fsync(f.fileno())
            with self.dir.eviction_lock():  # no eviction between the name and its chunk links
                try:
                    os.link(tmp, final)
                except FileExistsError:  # the same history, published meanwhile: a no-op
                    pass
                for h in record.chunk_hashes:
                    try:
                        os.link(final, self.names.chunk(h))
                    except FileExistsError:  # the chunk is already findable through another segment
                        pass
                # The temp name goes under the lock too: left until after it, another worker could
                # evict the new segment meanwhile and count its bytes freed while this name still
                # held them (one segment over the quota until the unlink).
                tmp.unlink()
        finally:
            tmp.unlink(missing_ok=True)  # a half-written file would hold the space a full disk lacks
        fsync_dir(self.root)
        record.file_bytes = size
        self.bytes_written += size
        self.eviction.used_bytes += size
        return evicted

    # --- delete --------------------------------------------------------------------------------
    def expire(self, ttl_s: float) -> list[str]:
        """Delete the segments (any worker's) not used for ``ttl_s`` seconds (:meth:`SegmentEviction.expire`)."""
        return self.eviction.expire(ttl_s)

    def delete(self, seg_id: str) -> None:
        """Remove a segment and the chunk links that point to it (under the eviction lock)."""
        self.eviction.delete(seg_id)

    def touch(self, seg_ids) -> None:
        """A use of these segments: their mtime is what eviction orders by, for every worker."""
        self.eviction.touch(seg_ids)

    # --- find ----------------------------------------------------------------------------------
    def find(self, chain: list[str], first: int, wait_s: float = PENDING_WAIT_S) -> Found | None:
        """The stored segment holding chunk ``first`` of the history whose chain hashes are
        ``chain``, and how many of the following chunks it holds too (one ``open``). None when no
        worker stored that chunk (or its segment was evicted); a chunk announced by a writer is
        waited for, up to ``wait_s`` (or longer for a long segment: :meth:`Announcements.wait_budget`), on this
        thread. The scheduler does not wait here: it uses :meth:`probe` and holds the request back."""
        deadline = None
        while True:
            found = self.probe(chain, first, wait_s)
            if not isinstance(found, Announced):
                return found
            deadline = deadline or time.monotonic() + found.wait_s
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def probe(self, chain: list[str], first: int, wait_s: float = PENDING_WAIT_S) -> Found | Announced | None:
        """:meth:`find` without waiting: an announced chunk whose writer may still publish it is
        :class:`Announced` (with how long it is worth waiting for), a chunk nobody stores None."""
        link = self.names.chunk(chain[first])
        try:
            fd = os.open(link, os.O_RDONLY)
        except FileNotFoundError:
            try:
                return self.announcements.awaited(chain[first], wait_s)
            except OSError:  # not announced, or published (and unannounced) since the open
                return self.probe(chain, first, wait_s) if os.path.exists(link) else None
        try:
            header = self.codec.header(fd, "chunk " + chain[first])
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

    def read_header(self, seg_id: str) -> dict:
        fd = self._open(seg_id)
        try:
            return self.codec.header(fd, seg_id)
        finally:
            os.close(fd)

    def read(
        self, seg_id: str, chunk_lo: int, chunk_hi: int, first_chunk: list[int] | None = None
    ) -> torch.Tensor | PackedKV:
        """KV of chunks [chunk_lo, chunk_hi) -> [L, 2, T, H, D] (or a PackedKV), every extent verified
        (:meth:`SegmentCodec.read`). The file is opened once: a worker evicting it meanwhile cannot
        take it away. Raises CorruptSegment (SegmentGone when it is no longer there)."""
        fd = self._open(seg_id)
        try:
            return self.codec.read(fd, seg_id, chunk_lo, chunk_hi, first_chunk)
        finally:
            os.close(fd)

    def open_for_chunks(self, seg_id: str) -> OpenSegment:
        """An open descriptor and the verified header of a segment whose chunks will be read a few
        at a time (:meth:`read_chunks`); the caller closes it. Held open, the file survives an
        eviction by any worker until then. Raises CorruptSegment (SegmentGone when it is not there)."""
        fd = self._open(seg_id)
        try:
            return OpenSegment(fd, self.codec.header(fd, seg_id))
        except BaseException:
            os.close(fd)
            raise

    def read_chunks(self, fd: int, seg_id: str, header: dict, layers: range, chunks: list[int]) -> ChunkRead:
        """Chunks of a segment opened by :meth:`open_for_chunks`, for ``layers`` (a gate's): (KV
        [len(layers), 2, n, c, H, D] per chunk, views of one read buffer (an int8 tier's: a QuantKV
        [len(layers), 2, n * c, H, D]), per layer the chunks that failed their checksum).
        Thread-safe (``preadv``)."""
        return self.codec.read_chunks(fd, seg_id, header, layers, chunks)

    def read_chunks_into(self, fd: int, header: dict, layers: range, chunks: list[int], k_rows, v_rows, pages):
        """:meth:`read_chunks` straight into pool pages (:meth:`SegmentCodec.read_chunks_into`): per
        layer the chunks that failed, or None when the read cannot go there. Thread-safe."""
        return self.codec.read_chunks_into(fd, header, layers, chunks, k_rows, v_rows, pages)

    def advise(self, fd: int, header: dict, layers: range, chunks: list[int]) -> int:
        """Hint a coming :meth:`read_chunks` to the kernel (:meth:`SegmentCodec.advise`)."""
        return self.codec.advise(fd, header, layers, chunks)

    def read_summaries(self, seg_id: str) -> torch.Tensor:
        """Key summaries [L, m, H, 2, D] (``summary_dtype``) of a whole segment."""
        fd = self._open(seg_id)
        try:
            return self.codec.read_summaries(fd, seg_id)
        finally:
            os.close(fd)

    @property
    def bytes_read(self) -> int:
        return self.codec.bytes_read

    @property
    def read_seconds(self) -> ReadSeconds:
        """Seconds in reads so far (:attr:`SegmentCodec.read_s`, :attr:`SegmentCodec.verify_s`): (preads, checksums)."""
        return ReadSeconds(self.codec.read_s, self.codec.verify_s)
