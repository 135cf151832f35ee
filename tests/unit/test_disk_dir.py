"""The disk tier's directory: shared by several workers (a shared hold that keeps a format-2 single
server out, and that a crash cannot leave behind) and a quota bounded by the filesystem's free
space (sgl_loopkv/cache/disk_dir.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sgl_loopkv.cache.disk_dir import DirectoryInUse, DirectoryLock, SharedDirectory, bounded_quota


def test_workers_share_the_directory_and_a_format_2_server_is_refused(tmp_path):
    first, second = DirectoryLock(tmp_path / "kv"), DirectoryLock(tmp_path / "kv")  # two workers: both hold it
    fd = os.open(tmp_path / "kv" / "lock", os.O_RDWR)
    with pytest.raises(BlockingIOError):  # what a format-2 server's exclusive lock meets
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    first.release()
    second.release()
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an old single server, holding it
    os.write(fd, b"pid 4242 on oldhost")
    with pytest.raises(DirectoryInUse, match="single-server sgl-loopkv of an older version .pid 4242 on oldhost"):
        DirectoryLock(tmp_path / "kv")
    os.close(fd)
    DirectoryLock(tmp_path / "kv").release()  # free again
    assert (tmp_path / "kv").stat().st_mode & 0o077 == 0 and (tmp_path / "kv" / "lock").stat().st_mode & 0o077 == 0


def test_a_killed_eviction_lock_holder_leaves_no_stale_lock(tmp_path):
    code = (
        f"from pathlib import Path; from sgl_loopkv.cache.disk_dir import SharedDirectory; "
        f"cm = SharedDirectory(Path({str(tmp_path)!r})).eviction_lock(); cm.__enter__(); "
        f"print('held', flush=True); import time; time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        fd = os.open(tmp_path / "evict.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the lock with the process
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    os.close(fd)
    with SharedDirectory(tmp_path).eviction_lock():
        pass


def test_the_quota_is_bounded_by_free_space_plus_what_the_tier_holds(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert bounded_quota(tmp_path / "new" / "kv", 1 << 20, 0.5) == 1 << 20  # configured: well below
    (tmp_path / "seg_a.kv").write_bytes(b"x" * 4096)
    (tmp_path / "host.1.abcd.8192.tmp").write_bytes(b"")  # a write in flight reserves its bytes
    got = bounded_quota(tmp_path, 1 << 62, 0.5)
    assert abs(got - 0.5 * (free + 4096 + 8192)) < 0.5 * (1 << 24)  # free space moves a little meanwhile
