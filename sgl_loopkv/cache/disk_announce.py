"""Announcements of segment writes in flight: ``chunks/<h>.pending`` for each chunk of a queued
segment, so that another worker's lookup waits for the write instead of recomputing what is being
written right now (the module doc of :mod:`sgl_loopkv.cache.disk`)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sgl_loopkv.cache.disk_dir import pid_alive
from sgl_loopkv.cache.disk_names import DiskNames
from sgl_loopkv.cache.segment_record import SegmentRecord

PENDING = ".pending"
PENDING_WAIT_S = 2.0  # a lookup waits at least this long for an announced segment
# ... and up to this much per token it announces, capped: a 3.5K-token float32 segment (~160 MB) took
# over 2 s to write with two busy workers on 2 cores, while recomputing it costs ~3-4 ms per token there
PENDING_WAIT_PER_TOKEN_S, PENDING_WAIT_MAX_S = 1e-3, 10.0
PENDING_STALE_S = 60.0  # an announcement this old belongs to a writer that died


@dataclass(frozen=True, slots=True)
class Announced:
    """A chunk that no segment holds yet but a live writer announced: its segment is on its way.
    ``wait_s``: how long a lookup should wait for it, from when it first saw the announcement."""

    wait_s: float


class Announcements:
    """This worker's announcements (``host``: its host name) and its reading of everyone's."""

    def __init__(self, names: DiskNames, host: str):
        self.names, self.host = names, host
        self._mine: dict[str, tuple[int, int]] = {}  # seg_id -> (device, inode) of its own marker

    def announce(self, record: SegmentRecord) -> None:
        """A write of ``record`` is queued: a lookup of any of its chunks waits for it (see the module
        doc). Every chunk is announced, not just the first: another worker's lookup starts wherever
        its own tree ends, often inside this segment (after a system prompt that many conversations
        share, say). One small file, hard-linked under each chunk's name (no bytes: a 3.5K-token
        segment's 220 names take ~2 ms). A chunk another writer announced keeps that writer's
        announcement: this one's marker goes only where there is none (:meth:`unannounce` removes
        only its own)."""
        if not record.chunk_hashes:
            return
        marker, mine = f"{self.host} {os.getpid()} {len(record.token_ids)}", None
        with contextlib.suppress(OSError):  # only an optimisation: a miss recomputes
            for h in record.chunk_hashes:
                name = self.names.chunk(h, PENDING)
                try:
                    if mine is not None:
                        os.link(mine, name)
                        continue
                    # whose (a dead writer's goes at start-up) and how many tokens (how long a lookup waits)
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:  # announced by another writer (or by this one for another turn)
                    continue
                try:
                    os.write(fd, marker.encode())
                    st = os.fstat(fd)
                except OSError:  # no marker rather than an empty one (read as a live writer's)
                    name.unlink(missing_ok=True)
                    raise
                finally:
                    os.close(fd)
                mine = name
                self._mine[record.seg_id] = (st.st_dev, st.st_ino)

    def unannounce(self, record: SegmentRecord) -> None:
        """The announced write will not happen (or is done): lookups stop waiting for it. Only this
        worker's own marker goes (the names hard-linked to the file :meth:`announce` created): a chunk
        that another writer announced is still theirs to publish, and lookups keep waiting for it."""
        mine = self._mine.pop(record.seg_id, None)
        if mine is None:
            return
        for h in record.chunk_hashes:
            name = self.names.chunk(h, PENDING)
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name)
                if (st.st_dev, st.st_ino) == mine:
                    name.unlink()

    def writer_gone(self, marker: str) -> bool:
        """An announcement (``host pid [tokens]``) whose writer was a process of this host now gone."""
        fields = marker.split()
        return len(fields) >= 2 and fields[0] == self.host and fields[1].isdigit() and not pid_alive(int(fields[1]))

    def stale(self, path: Path, mtime: float) -> bool:
        """An announcement (at ``path``, last written at ``mtime``) whose write will never come."""
        return self.writer_gone(path.read_text()) or time.time() - mtime > PENDING_STALE_S

    def wait_budget(self, marker: str, wait_s: float) -> float:
        """How long to wait for an announced write: ``wait_s``, or longer for a long segment (its
        write takes longer, its recompute longer still); nothing when its writer on this host is gone."""
        if self.writer_gone(marker):
            return 0.0
        fields = marker.split()
        tokens = int(fields[2]) if len(fields) >= 3 and fields[2].isdigit() else 0
        return max(wait_s, min(PENDING_WAIT_MAX_S, tokens * PENDING_WAIT_PER_TOKEN_S))

    def awaited(self, chunk_hash: str, wait_s: float) -> Announced | None:
        """The announcement of a chunk that no link names: :class:`Announced` while its writer may
        still publish it, None when it is stale or its writer gone. Raises ``OSError`` when the
        chunk is not announced (or was published, and unannounced, meanwhile)."""
        pending = self.names.chunk(chunk_hash, PENDING)
        if time.time() - pending.stat().st_mtime >= PENDING_STALE_S:
            return None
        budget = self.wait_budget(pending.read_text(), wait_s)
        return Announced(budget) if budget > 0 else None
