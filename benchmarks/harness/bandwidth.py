"""The machine's copy and cold-read bandwidths, measured in the benchmark's own process: the
denominators of a resume's limit (history bytes / bandwidth)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.stats import median


def copy_bps(nbytes: int = 256 << 20, passes: int = 5, threads: int = 1) -> float:
    """Bytes per second of ``dst.copy_(src)`` between two float32 buffers of ``nbytes`` (bytes
    counted once; median of ``passes`` after one warm pass) on ``threads`` torch threads: the
    loader thread copies a history into the pool on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.rand(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return nbytes / median(times)
    finally:
        torch.set_num_threads(before)


def cold_read_bps(directory: str | Path | None = None, nbytes: int = 256 << 20, passes: int = 3) -> float:
    """Bytes per second of a sequential read of an ``nbytes`` file in ``directory`` (the disk
    tier's file system) with its pages dropped from the page cache before each pass (median)."""
    fd, path = tempfile.mkstemp(prefix="loopkv-bw-", dir=directory)
    try:
        block = os.urandom(8 << 20)
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        times = []
        for _ in range(passes):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            at = 0
            while chunk := os.pread(fd, len(block), at):
                at += len(chunk)
            times.append(time.perf_counter() - t0)
        return nbytes // len(block) * len(block) / median(times)
    finally:
        os.close(fd)
        os.unlink(path)
