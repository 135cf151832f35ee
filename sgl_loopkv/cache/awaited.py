"""Requests whose history another worker is writing right now wait in the queue, not the scheduler.

Behind a router, a conversation's next turn can reach a worker before the previous turn's segment
is on the shared disk tier (the write-through is asynchronous; the writer announces it first:
:mod:`sgl_loopkv.cache.disk`). Waiting for the segment beats recomputing the history, but the
lookup used to wait inside ``match_prefix`` on the scheduler thread, up to 10 s, and every other
request of that worker (decodes in flight, new turns) stalled with it. Now the lookup only notes
the announcement (:meth:`LoopKVRadixCache.awaits_write`), and this AROUND hook on the scheduler's
``get_new_batch_prefill`` takes such requests out of the waiting queue for the call: the others
are admitted and decoded as usual, and the held ones are looked up again every round until the
segment is published (then they load it) or the announcement's wait budget is spent (then they
recompute). A request is never held past that budget, so none waits forever.

The same hold-back serves a history that only this worker's disk holds: its segments are read on
a thread while the request sits out the rounds (:mod:`sgl_loopkv.cache.prefetch`).
"""

from __future__ import annotations

import time

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
#: With nothing to run but requests held back, the scheduler's loop would spin on its core (which a
#: co-located worker's writer may be the one needing); it naps this long per round instead.
IDLE_NAP_S = 0.002


def hold_back_awaited(original, self, running_batch, *args, **kwargs):
    """AROUND hook of ``Scheduler.get_new_batch_prefill``: the waiting requests whose history is
    being written by another worker sit this call out (they keep their place at the queue's front)."""
    awaits = getattr(self.tree_cache, "awaits_write", None)
    queue = self.waiting_queue
    if awaits is None or not queue:
        return original(self, running_batch, *args, **kwargs)
    # a request that already holds KV (retracted, staged) is never held back
    held = [req for req in queue if not getattr(getattr(req, "kv", None), "holds_kv", False) and awaits(req)]
    if not held:
        return original(self, running_batch, *args, **kwargs)
    ids = {id(req) for req in held}
    self.waiting_queue = [req for req in queue if id(req) not in ids]
    try:
        plan = original(self, running_batch, *args, **kwargs)
    finally:
        self.waiting_queue = held + self.waiting_queue
    idle = plan.batch_to_run is None and plan.running_batch.is_empty()
    pace = getattr(self.tree_cache, "pace_reads", None)
    if pace is not None:  # a held request's read-ahead gives way while others run, reads flat out when idle
        pace(not idle)
    if idle:
        time.sleep(IDLE_NAP_S)
    return plan
