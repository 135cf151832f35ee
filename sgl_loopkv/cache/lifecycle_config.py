"""Stored conversations' lifecycle (issue 55: retention, isolation, encryption): its section of the
``--loopkv-*`` flags (:class:`LifecycleConfig`; composed by :class:`sgl_loopkv.config.LoopKVConfig`,
read by the tiers, :mod:`sgl_loopkv.cache.backend`, and the server's salt check)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sgl_loopkv.flags import Bytes

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, flag: str) -> float | None:
    """Seconds of a duration like ``30d``, ``12h``, ``90m``, ``3600s`` or ``3600``; None for
    ``off``/``none``/``0``. Raises ValueError naming ``flag`` for anything else."""
    t = str(text).strip().lower()
    if t in ("", "off", "none", "0"):
        return None
    unit = DURATION_UNITS.get(t[-1])
    number = t[:-1] if unit else t
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{flag} must be a duration like 30d, 12h, 90m or 3600s (or off), not {text!r}")
    return value


@dataclass(slots=True)
class LifecycleConfig:
    """How long the tiers keep a conversation (docs/operating/data-protection.md)."""

    title: ClassVar[str] = "retention and isolation"
    flag_prefix: ClassVar[str] = "lifecycle_"

    disk_ttl: str = field(
        default="off",
        metadata={
            "help": "Segments of the disk tier not used for this long are deleted, at start-up and every "
            "min(TTL / 4, 60 s) while the server runs (a use renews it): a duration like 30d, 12h, 90m or 3600s; "
            "'off' (default): kept until the quota evicts them or a forget (POST /loopkv/forget) removes them.",
            "type": str,
        },
    )

    require_salt: bool = field(
        default=False,
        metadata={
            "help": "A request without a cache_salt shares no cached KV with any other request, and its KV is not "
            "stored in the host or disk tier: the defence against reading other clients' prompts from the cache's "
            "timing (docs/operating/data-protection.md). Clients that send a cache_salt share within that salt.",
            "action": "store_true",
        },
    )

    pin_bytes: Bytes = field(
        default=0,
        metadata={
            "help": 'Host-arena bytes that requests with "loopkv": {"retain": "pin"} may pin in all (eviction skips '
            "pinned segments until the pin's ttl ends). A pin beyond it is stored unpinned and counted in "
            "loopkv_pins_refused. 0 (default): no pins.",
        },
    )

    tenant_host_share: float = field(
        default=1.0,
        metadata={
            "help": "Share, in (0, 1], of the host tier's quota that one tenant (its cache_salt; no salt: one "
            "'default' tenant) holds before the host tier's eviction takes that tenant's segments first. "
            "1 (default): no per-tenant share.",
        },
    )

    tenant_disk_share: float = field(
        default=1.0,
        metadata={
            "help": "Share, in (0, 1], of the disk tier's quota that one tenant holds: a store over it first "
            "deletes that tenant's own least valuable disk segments (those this worker knows). 1 (default): no "
            "per-tenant share.",
        },
    )

    disk_key_file: str = field(
        default="",
        metadata={
            "help": "Encrypt the disk tier's segment files (KV, summaries and headers with the token ids) with "
            "AES-256-GCM under the key in this file: 32 raw bytes or 64 hex digits, mode 0600 (the key is never "
            "written or logged). Files that do not decrypt are recomputed. Every worker sharing a disk directory "
            "needs the same file. Default '': files are not encrypted.",
            "metavar": "FILE",
        },
    )

    @property
    def disk_ttl_s(self) -> float | None:
        return parse_duration(self.disk_ttl, "--loopkv-lifecycle-disk-ttl")

    def __post_init__(self):
        parse_duration(self.disk_ttl, "--loopkv-lifecycle-disk-ttl")  # a clear error at start-up, not a silent default
        if self.pin_bytes < 0:
            raise ValueError(f"--loopkv-lifecycle-pin-bytes must be >= 0, got {self.pin_bytes}")
        for name in ("tenant_host_share", "tenant_disk_share"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(
                    f"--loopkv-{(self.flag_prefix + name).replace('_', '-')} must be in (0, 1], got {value}"
                )
