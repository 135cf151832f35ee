"""Memory for rows read out of a file or the pool, reused from one read to the next (:class:`ReadBuffers`,
one per tier store).

Why: a whole read (:mod:`sgl_loopkv.cache.segment_whole`) writes a history's rows, ~57 MB for 4K
tokens in an int8 tier, into freshly allocated memory, and the first touch of every fresh page is a
page fault the kernel answers by zeroing it. On the 2-core VMs here that was about a third of a read
whose file was in the page cache, and ~15 ms of a cold 4K read
(docs/decisions/2026-12-07-disk-read-buffers.md). Rows read into memory an earlier read has already
touched pay none of it. A quantized tier's store gathers a turn's rows from the pool into such memory
too (:meth:`~sgl_loopkv.cache.write_through.WriteThrough.gather`, on the scheduler thread): only their
int8 form is kept.

A buffer is an anonymous memory map: the rows are ``torch.frombuffer`` views of it, and a storage
made that way holds one reference to the map for as long as any tensor uses it. So a buffer is free
again exactly when its reference count is back to the pool's own, however its rows travelled (loaded
into the pool, promoted to the host arena and later evicted, or dropped): nobody has to give it back.
Mapped lazily, a new buffer's pages are still touched by the native read, without the GIL. Free
buffers beyond :data:`KEEP_BYTES` (``LOOPKV_READ_BUFFER_BYTES``) are unmapped, the least recently
used first, at each allocation and at :meth:`ReadBuffers.trim` (the write-through's periodic heap
trim), so what the pool holds beyond the rows in use stays bounded.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading

import torch

#: Free buffers kept for the next read, in bytes (about two 4K-token bfloat16 histories of the
#: default model); a read larger than this is allocated and freed as any tensor.
KEEP_BYTES = int(os.environ.get("LOOPKV_READ_BUFFER_BYTES", 256 << 20))
#: Smaller rows are ordinary tensors (the C heap keeps such blocks between calls without faulting them anew).
MIN_BYTES = 1 << 20
#: A free buffer serves a read of at least this fraction of its size, rounded (it is not split).
MIN_FILL = 0.8
_ROUND = 2 << 20  # sizes rounded up to this: a history one turn longer still fits


class _Buffer:
    __slots__ = ("mem", "size")

    def __init__(self, size: int):
        self.mem, self.size = mmap.mmap(-1, size), size


def _free(b: _Buffer) -> bool:
    """No tensor uses ``b``: its map is referenced by the pool's slot and this call's argument only."""
    return sys.getrefcount(b.mem) <= 2


class ReadBuffers:
    """``empty(shape, dtype)``: a tensor like ``torch.empty``'s, over a reused buffer where one is free
    and fits. Thread-safe (the read-ahead thread and the scheduler thread both read)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._buffers: list[_Buffer] = []  # least recently handed out first
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or nbytes > self.keep_bytes:
            return torch.empty(shape, dtype=dtype)
        size = -(-nbytes // _ROUND) * _ROUND
        with self._lock:
            fits = [b for b in self._buffers if size <= b.size and size >= MIN_FILL * b.size and _free(b)]
            if fits:
                b = min(fits, key=lambda x: x.size)
                self._buffers.remove(b)
            else:
                b = _Buffer(size)
            self._buffers.append(b)
            rows = torch.frombuffer(b.mem, dtype=torch.uint8, count=nbytes)  # holds the map from here on
            self._trim()
        return rows.view(dtype).view(shape)

    def trim(self) -> None:
        """Unmap free buffers beyond :attr:`keep_bytes`, the least recently used first."""
        with self._lock:
            self._trim()

    def _trim(self) -> None:
        free = [b for b in self._buffers if _free(b)]
        over = sum(b.size for b in free) - self.keep_bytes
        for b in free:
            if over <= 0:
                break
            self._buffers.remove(b)
            over -= b.size

    @property
    def held_bytes(self) -> int:
        """Every buffer's size, in use or free."""
        with self._lock:
            return sum(b.size for b in self._buffers)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._buffers if _free(b))
