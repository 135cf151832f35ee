"""The restore planner's section of the ``--loopkv-*`` flags (:class:`RestoreConfig`; composed by
:class:`sgl_loopkv.config.LoopKVConfig`, read by the planners of :mod:`sgl_loopkv.restore.plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class RestoreConfig:
    """How a returning history is restored (Krul): which layers' KV is loaded and which recomputed."""

    flag_prefix: ClassVar[str] = "restore_"
    title: ClassVar[str] = "restore planner"

    planner: str = field(
        default="krul",
        metadata={
            "help": "How a returning history is restored, layer by layer: 'krul' (the recompute/load split a cost "
            "model calibrated on this machine picks), 'load_all', 'recompute_all' or 'fixed' "
            "(--loopkv-restore-ratio of the front recomputed in every layer). The last three are baselines.",
            "registry": "sgl_loopkv.restore.plan:PLANNERS",
        },
    )
    ratio: float = field(
        default=0.4,
        metadata={
            "help": "Share of a history's front, in [0, 1], that the 'fixed' restore planner recomputes in every layer.",
            "baseline": True,
        },
    )
