"""The disk tier's directory: one server at a time (a lock that a crash cannot leave behind) and a
quota bounded by the filesystem's free space (sgl_loopkv/cache/disk_dir.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sgl_loopkv.cache.disk_dir import DirectoryInUse, DirectoryLock, bounded_quota


def test_a_second_holder_is_refused_with_the_first_named(tmp_path):
    first = DirectoryLock(tmp_path / "kv")
    with pytest.raises(DirectoryInUse, match=f"pid {os.getpid()} on .*--loopkv-disk-dir"):
        DirectoryLock(tmp_path / "kv")
    first.release()
    DirectoryLock(tmp_path / "kv").release()  # free again
    assert (tmp_path / "kv").stat().st_mode & 0o077 == 0 and (tmp_path / "kv" / "lock").stat().st_mode & 0o077 == 0


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = (
        f"from pathlib import Path; from sgl_loopkv.cache.disk_dir import DirectoryLock; "
        f"DirectoryLock(Path({str(tmp_path)!r})); print('held', flush=True); import time; time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUse, match=f"pid {proc.pid} "):
            DirectoryLock(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the lock with the process
        try:
            DirectoryLock(tmp_path).release()
            break
        except DirectoryInUse:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_the_quota_is_bounded_by_free_space_plus_what_the_tier_holds(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert bounded_quota(tmp_path / "new" / "kv", 1 << 20, 0.5) == 1 << 20  # configured: well below
    (tmp_path / "seg_a.kv").write_bytes(b"x" * 4096)
    got = bounded_quota(tmp_path, 1 << 62, 0.5)
    assert abs(got - 0.5 * (free + 4096)) < 0.5 * (1 << 24)  # free space moves a little meanwhile
