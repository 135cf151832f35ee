"""A background disk read gives way to the running requests: it works in short pieces and, while
other requests run, naps after each piece in proportion to the CPU the piece took.

Why: a read-ahead (:mod:`sgl_loopkv.cache.prefetch`) preads, verifies and lays out a whole history
(~130 MB for 2K tokens of a KV-heavy model) on a thread of its own, and on a machine whose cores the
forward's OpenMP team uses, every millisecond of CPU it takes is taken from that team, whose step
waits for its slowest thread. Lower priority alone (nice) was not enough: the team's threads sleep
between parallel regions and wake behind the reader, and a decode step beside the read still took
up to ~1.7x its median on 2 cores (docs/decisions/2026-12-06-read-ahead-niced.md). Paced, the
reader takes at most ``duty`` of one core while the scheduler has other requests running; with
nothing else running (the held request is all there is) it reads at full speed.

The reader also gives way by priority (nice, :func:`~sgl_loopkv.platform.yield_cpu_to_the_forward`)
while others run, and takes its priority back when nothing else runs: lowered, an idle server's read
lost its core to threads that had nothing to do (the forward's OpenMP team spinning after the
scheduler's round, the scheduler's own rounds) and a 4K-token resume from disk read at about half
the speed of a read at normal priority. Where the priority cannot be raised again (no
``CAP_SYS_NICE``) the reader stays lowered.

The scheduler says which it is every round (:meth:`ReadPacing.set_busy`, from the hold-back hook of
:mod:`sgl_loopkv.cache.awaited`); the reading code calls :func:`checkpoint` between pieces, which does
nothing on a thread without pacing (an inline read on the scheduler thread never naps).
"""

from __future__ import annotations

import threading
import time

from sgl_loopkv.platform import take_cpu_back, thread_priority, yield_cpu_to_the_forward

#: Bytes of work between two checkpoints: a piece of a read, a checksum or a layout copy takes a
#: millisecond or less of one core.
PIECE_BYTES = 1 << 20
MAX_NAP_S = 0.05  # one nap at most: a piece slowed by page faults must not stall the read for long

_local = threading.local()


class ReadPacing:
    """How a reader thread naps between pieces; :meth:`set_busy` from the scheduler thread,
    :meth:`checkpoint` from the reader thread that :meth:`install`-ed it."""

    def __init__(self, duty: float = 0.25):
        assert 0 < duty <= 1
        self.duty = duty
        self.busy = False  # other requests are running (a plain bool: written and read whole)
        self.naps = 0  # naps taken so far (for tests and metrics)
        self.nap_seconds = 0.0
        self._cpu = 0.0  # the reader thread's CPU clock at its last checkpoint
        self.by_priority = False  # the reader also gives way by priority (nice) while others run
        self._lowered = False  # its priority is lowered now
        self._can_raise = True  # raising it back was allowed so far
        self._nice = 0  # its priority before it was first lowered

    def set_busy(self, busy: bool) -> None:
        self.busy = busy

    def install(self, by_priority: bool = False) -> None:
        """Make this pacing the calling thread's (a reader thread's initializer calls it);
        ``by_priority``: lower its priority while others run (it starts lowered)."""
        _local.pacing = self
        self._cpu = time.thread_time()
        self.by_priority = by_priority
        if by_priority:
            self._nice = thread_priority()  # what "normal" is for this thread
            self._lowered = yield_cpu_to_the_forward()

    def _priority(self) -> None:
        """Lowered while others run; normal again when nothing else does (where allowed)."""
        if not self.by_priority or self.busy == self._lowered:
            return
        if self.busy:
            self._lowered = yield_cpu_to_the_forward()
            self.by_priority = self._lowered  # priorities cannot be set here: stop asking
        elif self._can_raise:
            self._can_raise = take_cpu_back(self._nice)
            self._lowered = not self._can_raise

    def pace(self) -> None:
        self._priority()
        cpu = time.thread_time()  # this thread's CPU, system time included: a pread's copy counts
        work, self._cpu = cpu - self._cpu, cpu
        if not self.busy or work <= 0 or self.duty >= 1:
            return
        nap = min(work * (1 / self.duty - 1), MAX_NAP_S)
        self.naps += 1
        self.nap_seconds += nap
        time.sleep(nap)
        self._cpu = time.thread_time()


def checkpoint() -> None:
    """Between two pieces of a read: nap if this thread is a paced reader and others are running."""
    pacing = getattr(_local, "pacing", None)
    if pacing is not None:
        pacing.pace()


def pieces(total: int) -> range:
    """Starts of the pieces of :data:`PIECE_BYTES` (the last one shorter) that ``total`` bytes make."""
    return range(0, total, max(PIECE_BYTES, 1))
