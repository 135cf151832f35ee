"""The disk tier's directory, shared by every worker of a cluster (processes on one machine, or
machines on one shared filesystem).

Nothing in it is a shared mutable index: segment files are immutable once published, and a
worker learns what others stored from the names alone (:mod:`sgl_loopkv.cache.disk`). The one
thing workers must agree on is the quota, so *eviction decisions* (which files go, and the space a
new file reserves) happen under an exclusive ``flock`` on ``evict.lock``; reads never take it. A
reader that has a file open keeps reading it after another worker unlinks it (POSIX keeps the
inode until the last descriptor closes), so eviction never pulls data out from under a read.

Space in flight is visible to every worker: a file being written is ``<host>.<pid>.<rand>.<bytes>.tmp``,
and the scan counts the bytes its name reserves. ``flock`` is released by the kernel when its
holder dies (``kill -9`` included), so a crash never leaves a stale lock; the temp files a dead
worker left are removed by the next worker that starts (same host: its pid is gone; another host:
older than :data:`STALE_TMP_S`).

Every worker also holds a *shared* ``flock`` on ``lock`` while it runs: a single-server
sgl-loopkv of format 2 takes that lock exclusively, so the two never run on one directory (the old
one would rewrite its index while this one deletes its files as legacy).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sgl_loopkv.cache.address import start_of

STALE_TMP_S = 3600.0  # a temp file of another host this old belongs to a writer that died
SEG_PREFIX, SEG_SUFFIX, TMP_SUFFIX = "seg_", ".kv", ".tmp"


class DirectoryInUse(RuntimeError):
    """A single-server (format 2) sgl-loopkv holds the directory."""


class DirectoryLock:
    """A shared hold on the directory, from construction until :meth:`release` or the end of the process."""

    def __init__(self, root: Path):
        root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the tier's own root (per-model dirs in it)
        root.mkdir(mode=0o700, exist_ok=True)
        self.path = root / "lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "a process that wrote no name"
            os.close(fd)
            raise DirectoryInUse(
                f"the disk tier directory {root} is in use by a single-server sgl-loopkv of an older version "
                f"({holder}), which cannot share it; stop that server, or give this one its own "
                "--loopkv-tier-disk-dir (or --loopkv-tier-disk-dir none)"
            ) from None
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """A published segment as the directory shows it: name, size, last use (mtime)."""

    seg_id: str
    nbytes: int
    mtime_ns: int

    @property
    def eviction_order(self) -> tuple[int, int, int]:
        """Oldest use first (whole seconds: one turn touches its whole path at once), and within one
        second the deepest segment first, so a history is cut from its end, never from its root;
        then the older use."""
        return self.mtime_ns // 1_000_000_000, -start_of(self.seg_id), self.mtime_ns


@dataclass(frozen=True, slots=True)
class Usage:
    published: list[SegmentFile]
    reserved: int  # bytes of files being written (temp files, by the size in their names)

    @property
    def total(self) -> int:
        return sum(f.nbytes for f in self.published) + self.reserved


class SharedDirectory:
    """Scans, the eviction lock and temp-file names of one tier directory."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname()

    @contextlib.contextmanager
    def eviction_lock(self) -> Iterator[None]:
        """Held around eviction decisions and publishing only (milliseconds), never around reads."""
        fd = os.open(self.root / "evict.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def tmp_path(self, nbytes: int) -> Path:
        return self.root / f"{self.host}.{os.getpid()}.{uuid.uuid4().hex[:8]}.{nbytes}{TMP_SUFFIX}"

    @staticmethod
    def _tmp_fields(name: str) -> tuple[str, int, int] | None:
        """(host, pid, reserved bytes) of a temp file name, None for a name of another shape."""
        parts = name.removesuffix(TMP_SUFFIX).rsplit(".", 3)
        if len(parts) != 4 or not (parts[1].isdigit() and parts[3].isdigit()):
            return None
        return parts[0], int(parts[1]), int(parts[3])

    def scan(self) -> Usage:
        """What the directory holds now: one ``scandir`` (done under the eviction lock, not per request)."""
        published, reserved = [], 0
        with os.scandir(self.root) as it:
            for e in it:
                try:
                    if e.name.startswith(SEG_PREFIX) and e.name.endswith(SEG_SUFFIX):
                        st = e.stat()
                        published.append(
                            SegmentFile(e.name[len(SEG_PREFIX) : -len(SEG_SUFFIX)], st.st_size, st.st_mtime_ns)
                        )
                    elif e.name.endswith(TMP_SUFFIX):
                        st, fields = e.stat(), self._tmp_fields(e.name)
                        if st.st_nlink == 1:  # more links: published meanwhile, counted under its name
                            reserved += max(st.st_size, fields[2] if fields else 0)
                except FileNotFoundError:  # removed by another worker while we looked
                    continue
        return Usage(published, reserved)

    def remove_stale_tmp(self) -> int:
        """Remove temp files of writers that are gone; returns how many (under the eviction lock)."""
        removed = 0
        for f in self.root.glob("*" + TMP_SUFFIX):
            fields = self._tmp_fields(f.name)
            try:
                if fields and fields[0] == self.host:
                    stale = not pid_alive(fields[1])
                else:  # another host's (or a name of another shape): only when clearly abandoned
                    stale = time.time() - f.stat().st_mtime > STALE_TMP_S
                if stale:
                    f.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed


class Presence:
    """Whether another process uses the directory now. Every store holds a POSIX read lock on
    ``workers`` while it lives; ``F_GETLK`` asks the kernel (or the NFS lock manager) for a lock that
    would conflict with a write lock, and POSIX locks never conflict with the asking process's own.
    Why: a write that another worker may be waiting for (its lookup found the announcement) must
    not run at background priority (docs/decisions/2026-11-26-two-disk-writers.md)."""

    # struct flock on Linux, 64-bit off_t: l_type, l_whence, l_start, l_len, l_pid (+ padding)
    _FLOCK = "hhqqi4x"

    def __init__(self, root: Path):
        self._fd: int | None = os.open(root / "workers", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # no POSIX locks here (or a writer holds one): others() says "maybe"
            pass

    def others(self) -> bool:
        """True when another process holds the directory, or when this cannot be told."""
        if self._fd is None:
            return True
        try:
            ask = struct.pack(self._FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            got = struct.unpack(self._FLOCK, fcntl.fcntl(self._fd, fcntl.F_GETLK, ask))
        except (OSError, struct.error):
            return True
        return got[0] != fcntl.F_UNLCK

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops this process's locks on the file
            self._fd = None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def bounded_quota(root: Path, configured: int, free_share: float) -> int:
    """The disk tier's byte quota: ``configured``, but never more than ``free_share`` of what the
    filesystem has left at start-up plus what the tier already holds there (its own files are space
    it may keep using)."""
    held = SharedDirectory(root).scan().total if root.exists() else 0
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    return min(configured, int(free_share * (shutil.disk_usage(probe).free + held)))
