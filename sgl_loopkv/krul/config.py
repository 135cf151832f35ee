"""Cross-layer KV sharing's section of the ``--loopkv-*`` flags (:class:`SharingConfig`; composed by
:class:`sgl_loopkv.config.LoopKVConfig`, read by the cache's :class:`~sgl_loopkv.cache.sharing.LayerSharing`
and the attention backend's observer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class SharingConfig:
    """Krul's cross-layer sharing: paired layers of a finished turn stored as one row (lossy)."""

    flag_prefix: ClassVar[str] = "share_"
    title: ClassVar[str] = "cross-layer KV sharing"

    layers: str = field(
        default="none",
        metadata={
            "help": "Store paired layers of a finished turn as one row: 'none' (off), 'reuse' (the deeper layer "
            "reuses the shallower one's KV) or 'minicache' (SLERP-merged directions, per-token magnitudes, "
            "outliers kept).",
            "registry": "sgl_loopkv.krul.codec:CODECS",
            "off": "none",
        },
    )
    gamma: float = field(
        default=0.5,  # 90% of SmolLM2's layers; uniform attention scores 0.2
        metadata={
            "help": "Layers whose attention mass on the initial and recent tokens reaches this share, in [0, 1], "
            "are sharing candidates (Krul's I-R layers)."
        },
    )
    ratio: float = field(
        default=0.25,  # the largest r_l keeping greedy agreement >= 0.9 on SmolLM2
        metadata={"help": "Share of all layers, in [0, 1], that may end up in a pair (Krul's r_l)."},
    )
    pairing: str = field(
        default="optimal",
        metadata={
            "help": "How pairs are picked: 'greedy' (Krul's Algorithm 1) or 'optimal' (minimum-distance matching).",
            "registry": "sgl_loopkv.krul.pairing:PAIRINGS",
        },
    )
    stride: int = field(
        default=4,  # 0.25% distance error, same pairs, 1/4 of the exact cost
        metadata={
            "help": "Layer similarity is estimated from the token positions that are multiples of this, in "
            "prefill and decode (1: every position, exact)."
        },
    )

    @property
    def enabled(self) -> bool:
        return self.layers != "none"

    def __post_init__(self):
        if not 0 <= self.gamma <= 1 or not 0 <= self.ratio <= 1 or self.stride < 1:
            raise ValueError("--loopkv-share-gamma/-ratio must be in [0, 1] and --loopkv-share-stride >= 1")
