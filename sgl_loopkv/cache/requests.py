"""What the tiered cache remembers about each request between scheduler rounds: one record per
request id in one bounded map (the oldest forgotten first), not a map per concern.

A request is matched several times before it runs (a hold-back probe, then SGLang's own match),
so what a lookup found or started must outlive the call; and after it finishes, its response
reports where its cached tokens came from (:meth:`LoopKVRadixCache.tier_breakdown`). Entries are
never dropped explicitly: a request that is gone stops being touched and ages out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

CAPACITY = 4096  # requests remembered: far more than a scheduler holds at once


@dataclass(slots=True)
class RequestState:
    # tokens its matches loaded, by source tier ("shared": the part of "disk" another worker wrote)
    loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "shared": 0})
    # the last shared-disk discovery: (prompt chunks, their chain hashes, where it ended, when;
    # -inf: look again next round)
    lookup: tuple[int, list[str], int, float] | None = None
    # what it is held back for: (an announced chunk's hash or READ_AHEAD, until when, still waiting)
    awaiting: tuple[str, float, bool] | None = None
    probed: bool = False  # looked up at least once (the hold-back probe runs once per wait)
    probing: bool = False  # in the hold-back probe's match: a disk-only history is read ahead, not loaded
    pin: str | None = None  # its "retain": "pin" outcome (retention.pin_outcome)
    pruned: object | None = None  # its finished chunk-pruned restore's accounting (PrunedStats)


class RequestStates:
    """rid -> :class:`RequestState`, least recently touched first, at most ``capacity``."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._states: OrderedDict[str, RequestState] = OrderedDict()

    def get(self, rid: str) -> RequestState | None:
        """The request's state if remembered (not touched: a read changes nothing)."""
        return self._states.get(rid)

    def of(self, rid: str) -> RequestState:
        """The request's state, created if new; touched (the last to be forgotten)."""
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = RequestState()
            while len(self._states) > self.capacity:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(rid)
        return state

    def __len__(self) -> int:
        return len(self._states)
