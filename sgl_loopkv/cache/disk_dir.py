"""The disk tier's directory: one server at a time (a lock), and a quota the filesystem can hold.

Two servers on one directory would each rewrite the index from their own view and delete the
other's segment files as orphans, so the second is refused, with a message naming the first. The
lock is ``flock`` on a file in the directory: the kernel drops it when its holder dies (``kill -9``
included), so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path


class DirectoryInUse(RuntimeError):
    """Another live process holds the directory's lock."""


class DirectoryLock:
    """Held from construction until :meth:`release` or the end of the process."""

    def __init__(self, root: Path):
        root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the tier's own root (per-model dirs in it)
        root.mkdir(mode=0o700, exist_ok=True)
        self.path = root / "lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "a process that wrote no name"
            os.close(fd)
            raise DirectoryInUse(
                f"the disk tier directory {root} is in use by another sgl-loopkv server ({holder}); stop that "
                "server, or give this one its own --loopkv-disk-dir (or --loopkv-disk-dir none)"
            ) from None
        os.ftruncate(fd, 0)
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {when}".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def bounded_quota(root: Path, configured: int, free_share: float) -> int:
    """The disk tier's byte quota: ``configured``, but never more than ``free_share`` of what the
    filesystem has left at start-up plus what the tier already holds there (its own files are space
    it may keep using)."""
    held = sum(f.stat().st_size for f in root.glob("seg_*.kv")) if root.exists() else 0
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    return min(configured, int(free_share * (shutil.disk_usage(probe).free + held)))
