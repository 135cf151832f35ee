"""What leaves the disk tier's shared directory, and the bytes it holds: least recently used
segments (any worker's, by mtime) evicted to make room under the quota, segments expired by age or
deleted, each with the chunk links that point to it, and the links a crash left dangling."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sgl_loopkv.cache.disk_announce import PENDING, Announcements
from sgl_loopkv.cache.disk_dir import SharedDirectory
from sgl_loopkv.cache.disk_names import CHUNK_HASH, CHUNKS, SEG_ID, DiskNames
from sgl_loopkv.cache.segment_record import CorruptSegment


class NoRoom(Exception):
    """The quota cannot hold a new segment (everything else is in use or it is too big alone)."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentEviction:
    """Removes segments from the directory of ``names`` and keeps the tally of its bytes
    (:attr:`used_bytes`, as of the latest scan: every write rescans). ``header`` reads the verified
    header of an open segment file (its chunk hashes name its links)."""

    def __init__(self, shared: SharedDirectory, names: DiskNames, header: Callable[[int, str], dict]):
        self.dir, self.names, self.header = shared, names, header
        self.used_bytes = 0

    def remove_dangling_links(self, announcements: Announcements) -> None:
        """Chunk links whose segment is gone (a crash mid-eviction): they would keep its bytes alive;
        announcements of writes that never finished."""
        with os.scandir(self.names.root / CHUNKS) as it:
            for e in it:
                try:
                    st = e.stat()
                    if e.name.endswith(PENDING):
                        if announcements.stale(Path(e.path), st.st_mtime):
                            os.unlink(e.path)
                    elif st.st_nlink == 1:
                        os.unlink(e.path)
                except FileNotFoundError:
                    continue

    def make_room(self, nbytes: int, quota_bytes: int, keep: str) -> list[str]:
        """Under the eviction lock: delete least recently used segments until ``nbytes`` more fit
        under ``quota_bytes``; -> their ids. Raises :class:`NoRoom` when they cannot."""
        if nbytes > quota_bytes:
            raise NoRoom(f"a segment of {nbytes} B does not fit the disk quota of {quota_bytes} B")
        usage = self.dir.scan()
        used, evicted = usage.total, []
        for victim in sorted(usage.published, key=lambda f: f.eviction_order):
            if used + nbytes <= quota_bytes:
                break
            if victim.seg_id == keep or not SEG_ID.fullmatch(victim.seg_id):
                continue
            self.unlink(victim.seg_id)
            used -= victim.nbytes
            evicted.append(victim.seg_id)
        self.used_bytes = used
        if used + nbytes > quota_bytes:
            raise NoRoom(f"{used} B of segments in use leave no room for {nbytes} B under {quota_bytes} B")
        return evicted

    def expire(self, ttl_s: float) -> list[str]:
        """Delete the segments (any worker's) not used for ``ttl_s`` seconds (their mtime, which every
        use renews); -> their ids. A reader that has one open reads it to the end."""
        cutoff = time.time_ns() - int(ttl_s * 1e9)
        with self.dir.eviction_lock():
            old = [f.seg_id for f in self.dir.scan().published if f.mtime_ns < cutoff and SEG_ID.fullmatch(f.seg_id)]
            for seg_id in old:
                self.unlink(seg_id)
        if old:
            fsync_dir(self.names.root)
        return old

    def delete(self, seg_id: str) -> None:
        """Remove a segment and the chunk links that point to it (under the eviction lock)."""
        with self.dir.eviction_lock():
            self.unlink(seg_id)

    def unlink(self, seg_id: str) -> None:
        """Links first, the name last: a crash in between leaves a findable-by-name segment, never a
        link keeping bytes of a segment that is gone (those are removed at start-up anyway)."""
        path = self.names.segment(seg_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            ino = os.fstat(fd)
            try:
                hashes = self.header(fd, seg_id).get("chunk_hashes", [])
            except CorruptSegment:
                hashes = []  # a damaged header: its links, if any, go at the next start-up
            for h in hashes:
                link = self.names.chunk(h) if isinstance(h, str) and CHUNK_HASH.fullmatch(h) else None
                with contextlib.suppress(FileNotFoundError):  # removed by another worker meanwhile
                    if link is not None and os.path.samestat(os.stat(link), ino):
                        os.unlink(link)
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        self.used_bytes = max(self.used_bytes - ino.st_size, 0)

    def touch(self, seg_ids: Iterable[str]) -> None:
        """A use of these segments: their mtime is what eviction orders by, for every worker."""
        for seg_id in seg_ids:
            with contextlib.suppress(FileNotFoundError):  # removed by another worker meanwhile
                os.utime(self.names.segment(seg_id))
