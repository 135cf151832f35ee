"""The host and disk tiers' section of the ``--loopkv-*`` flags (:class:`TierConfig`; composed by
:class:`sgl_loopkv.config.LoopKVConfig`, read by :mod:`sgl_loopkv.cache.backend`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sgl_loopkv.flags import Bytes


@dataclass(slots=True)
class TierConfig:
    """The loopkv radix cache's host and disk tiers: where conversations evicted from the KV pool are
    kept, and what survives a restart."""

    flag_prefix: ClassVar[str] = "tier_"
    title: ClassVar[str] = "host and disk tiers"

    host_bytes: Bytes = field(
        default=2 << 30,
        metadata={
            "help": "Byte quota of the host-RAM tier, which keeps the KV of conversations evicted from the pool."
        },
    )
    disk_dir: str = field(
        default="auto",
        metadata={
            "help": "Directory of the disk tier; conversations stored there are resumed after a restart. 'auto': "
            "<cache-dir>/kv; 'none': no disk tier. Several servers may share one directory (a cluster's workers, "
            "or servers on a shared filesystem): each resumes what the others stored.",
            "metavar": "DIR",
        },
    )
    disk_bytes: Bytes = field(
        default=20 << 30,
        metadata={"help": "Byte quota of the disk tier."},
    )
    disk_free_share: float = field(
        default=0.5,
        metadata={
            "help": "Cap on the disk tier's quota: this share, in (0, 1], of its filesystem's free space at "
            "start-up plus what the tier already holds there."
        },
    )
    disk_read: str = field(
        default="background",
        metadata={
            "help": "How a returning history that only the disk tier holds is read: 'background' (on a thread "
            "while the request waits in the queue, the other requests running meanwhile) or 'inline' (inside the "
            "scheduler's prefix match, every other request waiting). Chunk-pruned restores "
            "(--loopkv-prefix-budget, --loopkv-prefix-stream) read their own chunks either way.",
            "choices": ["background", "inline"],
        },
    )
    value_policy: str = field(
        default="attention",
        metadata={
            "help": "What the host and disk tiers evict first: 'attention' (the lowest attention importance x "
            "accesses, decayed) or 'lru' (the least recently used).",
            "registry": "sgl_loopkv.cache.value:VALUE_POLICIES",
        },
    )
    store_dtype: str = field(
        default="pool",
        metadata={
            "help": "dtype of the KV kept in the host and disk tiers: 'pool' (the KV pool's own, exact), "
            "'bfloat16' or 'float16' (half the bytes of a float32 pool, lossy) or 'int8' (8-bit values with a "
            "float32 scale per token and KV head, lossy). Loads decode back to the pool's dtype.",
            "choices": ["pool", "bfloat16", "float16", "int8"],
        },
    )

    @property
    def disk_path(self) -> Path | None:
        """The disk tier's directory, None when it is off (``auto`` is resolved by :class:`LoopKVConfig`)."""
        off = not self.disk_dir or self.disk_dir.lower() in ("none", "off")
        return None if off else Path(self.disk_dir).expanduser()

    def __post_init__(self):
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("--loopkv-tier-host-bytes and --loopkv-tier-disk-bytes must be >= 0")
        if not 0 < self.disk_free_share <= 1:
            raise ValueError("--loopkv-tier-disk-free-share must be in (0, 1]")
