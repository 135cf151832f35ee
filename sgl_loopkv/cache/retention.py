"""Per-request retention hints, pins and per-tenant shares of the host and disk tiers.

A request may carry ``"loopkv": {"retain": "pin" | "default" | "none", "ttl": seconds}`` (checked at
the HTTP layer, :mod:`sgl_loopkv.server.retention`, and carried to the scheduler in
``sampling_params.custom_params["loopkv"]``):

- ``none``: the turn's KV is not stored in the host or disk tier (device tree only, evicted as usual).
- ``pin``: the segments of the turn's history are pinned in the host arena: its eviction skips them
  until the pin's ``ttl`` ends (no ttl: until a forget or a restart), within ``--loopkv-lifecycle-pin-bytes``
  of pinned host bytes in all. A pin that does not fit is *degraded*, not failed: the segment is
  stored unpinned (``default``) and counted (``loopkv_pins_refused``).

The tenant of a segment is its ``cache_salt`` (no salt: one shared ``default`` tenant). With a
share under 1, eviction takes the entries of a tenant over its share first, so one tenant's
pressure falls on its own entries (:meth:`RetentionBook.victim`).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

KEY = "loopkv"  # the body field, and its key in custom_params
RETAIN = ("pin", "default", "none")
MAX_TTL_S = 366 * 24 * 3600.0
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Retention:
    """One request's hint: ``retain`` one of :data:`RETAIN`; ``ttl_s`` (pins only) seconds, None: no end."""

    retain: str = "default"
    ttl_s: float | None = None


DEFAULT = Retention()


def parse_hint(value) -> Retention:
    """The hint of a request body's ``loopkv`` field; raises ``ValueError`` with a message for the client."""
    if value is None:
        return DEFAULT
    if not isinstance(value, dict):
        raise ValueError(f'"{KEY}" must be an object like {{"retain": "pin", "ttl": 600}}, got {type(value).__name__}')
    unknown = sorted(set(value) - {"retain", "ttl"})
    if unknown:
        raise ValueError(f'unknown "{KEY}" field(s) {unknown}; it takes "retain" and "ttl"')
    retain = value.get("retain", "default")
    if retain not in RETAIN:
        raise ValueError(f'"{KEY}.retain" must be one of {list(RETAIN)}, got {retain!r}')
    ttl = value.get("ttl")
    if ttl is None:
        return Retention(retain)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl):
        raise ValueError(f'"{KEY}.ttl" must be a number of seconds, got {ttl!r}')
    if not 0 < ttl <= MAX_TTL_S:
        raise ValueError(f'"{KEY}.ttl" must be in (0, {MAX_TTL_S:.0f}] seconds, got {ttl!r}')
    if retain != "pin":
        raise ValueError(f'"{KEY}.ttl" applies to "retain": "pin" only (got "retain": {retain!r})')
    return Retention(retain, float(ttl))


def of_request(req) -> Retention:
    """The hint a scheduler ``Req`` carries (the HTTP layer checked it; anything else: ``default``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(params, dict) or KEY not in params:
        return DEFAULT
    try:
        return parse_hint(params[KEY])
    except ValueError:  # not through our HTTP layer (an engine API caller): ignored as it was before
        return DEFAULT


def pin_path(cache, node, ttl_s: float | None) -> list[bool]:
    """Pin every stored segment of the history that ends at tree ``node`` (root first); -> which were pinned."""
    seg_ids = []
    while node is not cache.root_node:
        ref = getattr(node, "lkv", None)
        if ref is not None and ref[0] not in seg_ids:
            seg_ids.append(ref[0])
        node = node.parent
    return [cache.store.pin(seg_id, ttl_s) for seg_id in reversed(seg_ids)]


def pin_outcome(pinned: list[bool]) -> str:
    """What a pin request's answer reports: ``pinned`` (its whole stored history), ``partial`` (its front:
    the pin quota ran out), ``degraded`` (nothing pinned: over the quota, or nothing stored)."""
    if pinned and all(pinned):
        return "pinned"
    return "partial" if any(pinned) else "degraded"


def tenant_of(cache_salt: str | None) -> str:
    return cache_salt or DEFAULT_TENANT


TENANT_BUCKETS = 16  # metrics labels per tier: "default" and t-0 .. t-f


def tenant_label(tenant: str) -> str:
    """The metrics label of a tenant: ``default``, or ``t-`` and its salt's hash bucket (one of
    :data:`TENANT_BUCKETS`): bounded whatever the clients send, and it does not show the salt."""
    if tenant == DEFAULT_TENANT:
        return tenant
    return f"t-{hashlib.blake2b(tenant.encode(), digest_size=1).digest()[0] % TENANT_BUCKETS:x}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A segment eviction may take: its id, tenant, bytes in the tier, value (lowest goes first)."""

    seg_id: str
    tenant: str
    nbytes: int
    value: float


class RetentionBook:
    """Pins of host segments (``pin_bytes`` in all) and the tenants' shares (fractions in (0, 1]
    of a tier's quota; 1: no share). Scheduler thread only; ``clock`` in seconds."""

    def __init__(
        self,
        pin_bytes: int = 0,
        host_share: float = 1.0,
        disk_share: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pin_bytes, self.host_share, self.disk_share, self.clock = pin_bytes, host_share, disk_share, clock
        self.pins: dict[str, tuple[float, int]] = {}  # seg_id -> (until, host bytes)
        self.refused = 0  # pins degraded to default: over the pin quota

    def pin(self, seg_id: str, nbytes: int, ttl_s: float | None) -> bool:
        """Pin ``seg_id`` (``nbytes`` in the host arena) for ``ttl_s``; a pinned one gets the later end.
        False (and counted) when it does not fit the pin quota: it stays unpinned."""
        until = math.inf if ttl_s is None else self.clock() + ttl_s
        self._expire()
        old = self.pins.get(seg_id)
        if old is not None:
            self.pins[seg_id] = (max(old[0], until), old[1])
            return True
        if self.pinned_bytes + nbytes > self.pin_bytes:
            self.refused += 1
            return False
        self.pins[seg_id] = (until, nbytes)
        return True

    def unpin(self, seg_id: str) -> None:
        self.pins.pop(seg_id, None)

    def pinned(self, seg_id: str) -> bool:
        pin = self.pins.get(seg_id)
        if pin is not None and pin[0] <= self.clock():
            del self.pins[seg_id]
            return False
        return pin is not None

    @property
    def pinned_bytes(self) -> int:
        self._expire()
        return sum(n for _, n in self.pins.values())

    def _expire(self) -> None:
        now = self.clock()
        for seg_id in [s for s, (until, _) in self.pins.items() if until <= now]:
            del self.pins[seg_id]

    def victim(
        self, candidates: Iterable[Candidate], quota: int, share: float, tenant: str | None = None, incoming: int = 0
    ) -> Candidate | None:
        """The segment to evict next from a tier of ``quota`` bytes holding ``candidates``, to make
        room for ``incoming`` bytes of ``tenant``: pinned ones never; of a tenant over its ``share``
        (counting the incoming bytes) first; the lowest value among those. None: nothing may go."""
        candidates = list(candidates)
        free = [c for c in candidates if not self.pinned(c.seg_id)]
        if not free:
            return None
        if share < 1.0:
            used: dict[str, int] = {}
            for c in candidates:
                used[c.tenant] = used.get(c.tenant, 0) + c.nbytes
            if tenant is not None:
                used[tenant] = used.get(tenant, 0) + incoming
            over = {t for t, n in used.items() if n > share * quota}
            mine = [c for c in free if c.tenant in over]
            free = mine or free
        return min(free, key=lambda c: c.value)
