"""Reading a segment file's extents: runs of adjacent extents (:class:`~sgl_loopkv.cache.layout.Block`)
read with one ``pread``/``preadv`` each, verified extent by extent, counted; a chunk-pruned restore's
reads issued together on a small thread pool owned by the reader (started on first use)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sgl_loopkv.cache import read_pacing
from sgl_loopkv.cache.layout import Block, SegmentFileLayout
from sgl_loopkv.cache.segment_check import SegmentCheck, crc32

READS_IN_FLIGHT = 4  # a chunk-pruned restore's reads of one gate issued together


@dataclass(slots=True)
class ReadCounters:
    """What the reads of one codec cost so far."""

    bytes_read: int = 0
    reads: int = 0  # extent reads issued (cold reads cost per request here, not per byte)
    read_s: float = 0.0  # Python-side reads (preads), summed over threads
    verify_s: float = 0.0  # and their crc32s or decryption

    def add(self, nbytes: int, reads: int, read_s: float, verify_s: float) -> None:
        """Count a native read (:mod:`sgl_loopkv.kernels.chunk_io`)."""
        self.bytes_read += nbytes
        self.reads += reads
        self.read_s += read_s
        self.verify_s += verify_s


class PreadPool:
    """Threads that keep several reads in flight together (``pread`` drops the GIL). The pool is
    started by the first :meth:`map` and stopped by :meth:`close` (a later :meth:`map` starts it
    again); idle, its threads wait on its queue."""

    def __init__(self, workers: int = READS_IN_FLIGHT):
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        """``fn`` over ``items`` on the pool's threads, every call submitted now; results in order."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="loopkv-pread")
            pool = self._pool
        return pool.map(fn, items)

    def close(self) -> None:
        """Stop the threads (after the reads already submitted)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def fetch(
    fd: int,
    layout: SegmentFileLayout,
    header: dict,
    blocks: list[Block],
    check: SegmentCheck,
    counters: ReadCounters,
    pool: PreadPool | None = None,
    into: list[np.ndarray] | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each block's extents -> ([n_chunks, rows, extent bytes], ok [n_chunks, rows]: read whole and
    crc32 verified, or decrypted under its tag), one block at a time (used while its buffer is still in the CPU cache).
    ``pool``: the reads in flight together on it (scattered runs are latency-bound on a cold
    file; pread drops the GIL). ``into``: per block, the contiguous uint8 array [n_chunks, rows,
    extent bytes] to read into (``preadv``: the kernel's copy is the only one), yielded back."""
    eb, crcs = check.geometry.extent_bytes, header.get("extent_crc32")

    def pread(i: int) -> bytes | np.ndarray:
        b, t0 = blocks[i], time.perf_counter()
        if into is None:
            buf = os.pread(fd, b.length(eb), b.offset)
        else:  # in pieces: a paced reader gives way between them (read_pacing)
            flat, got = into[i].reshape(-1), 0
            for start in read_pacing.pieces(flat.nbytes):
                n = os.preadv(fd, [flat[start : start + read_pacing.PIECE_BYTES]], b.offset + start)
                got += n
                if n < min(read_pacing.PIECE_BYTES, flat.nbytes - start):  # end of file: cut short
                    break
                read_pacing.checkpoint()
            buf = flat[:got]
        counters.read_s += time.perf_counter() - t0
        return buf

    order = range(len(blocks))
    bufs = pool.map(pread, order) if pool is not None and len(blocks) > 1 else map(pread, order)
    for i_block, (b, buf) in enumerate(zip(blocks, bufs)):
        counters.bytes_read += len(buf)
        counters.reads += 1
        n = b.n_chunks * (b.row1 - b.row0)
        got, mv, k0 = len(buf) // eb, memoryview(buf), (b.offset - layout.kv_offset) // eb
        t0 = time.perf_counter()
        if check.cipher is None:
            ok = np.zeros(n, bool)
            per_piece = max(read_pacing.PIECE_BYTES // eb, 1)
            for i0 in range(0, n, per_piece):
                for i in range(i0, min(i0 + per_piece, n)):
                    ok[i] = i < got and crc32(mv[i * eb : (i + 1) * eb]) == crcs[k0 + i]
                read_pacing.checkpoint()
        else:  # decrypted in place (a read into ``into``) or into a new buffer (``buf`` is bytes)
            buf = buf if into is not None else np.empty(got * eb, np.uint8)
            ok = check.open_extents(header, k0, mv, memoryview(buf).cast("B"), min(got, n), n)
        counters.verify_s += time.perf_counter() - t0
        shape = (b.n_chunks, b.row1 - b.row0)
        if into is not None:  # read in place: a short read's missing extents are not ok (the caller zeroes them)
            yield into[i_block], ok.reshape(shape)
            continue
        arr = np.frombuffer(buf, np.uint8, got * eb).reshape(got, eb)  # a view: no copy of a whole read
        if got < n:  # cut short: the missing extents zero (and not ok)
            arr = np.concatenate([arr, np.zeros((n - got, eb), np.uint8)])
        yield arr.reshape(*shape, eb), ok.reshape(shape)
