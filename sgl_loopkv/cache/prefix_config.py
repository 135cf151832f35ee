"""Chunk-pruned re-prefill's section of the ``--loopkv-*`` flags (:class:`PrefixConfig`; composed by
:class:`sgl_loopkv.config.LoopKVConfig`, read by the cache's pruned restores, :mod:`sgl_loopkv.cache.pruned`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from sgl_loopkv.flags import Option


@dataclass(slots=True)
class PrefixConfig:
    """Chunk-pruned re-prefill (ContiguousKV): a returning history is loaded chunk by chunk, only the
    chunks the new turn's queries need, selected once per period of layers."""

    flag_prefix: ClassVar[str] = "prefix_"
    title: ClassVar[str] = "chunk-pruned re-prefill"

    budget: float = field(
        default=1.0,
        metadata={
            "help": "Share, in (0, 1], of a returning history's 16-token chunks the new turn attends to, rounded up "
            "to whole chunks; the first chunk and the --loopkv-prefix-local nearest are always among them. 1.0: "
            "every chunk, exactly a full load; lower budgets restore faster and may change answers."
        },
    )
    period: int = field(
        default=8,
        metadata={"help": "Layers one chunk selection is reused for (it is made at the period's first layer)."},
    )
    gate: int = field(
        default=4,
        metadata={
            "help": "Layers of a period whose reads a layer's compute waits for together; also the layer grouping "
            "of the disk segments this server writes, unless --loopkv-prefix-layer-group sets one."
        },
    )
    local: int = field(
        default=4,
        metadata={"help": "Chunks nearest the new turn that are always kept."},
    )
    prefetch: float = field(
        default=0.0,
        metadata={
            "help": "Share, in [0, 1], of a period's selected chunks read ahead for the next period before its own "
            "selection: the always-kept chunks first, then the best scored (1.0: the whole set, ContiguousKV's "
            "inter-period prefetch; 0: only the always-kept chunks)."
        },
    )
    min_tokens: int = field(
        default=1024,
        metadata={"help": "Histories shorter than this many tokens are loaded whole."},
    )
    stream: bool = field(
        default=False,
        metadata={
            "help": "At budget 1.0 too, restore a returning history chunk by chunk: a disk hit is admitted from its "
            "header and its chunks read period by period during the new turn's prefill, each verified before use "
            "(off: the history is read and verified whole, then loaded with the restore planner's recompute).",
            "action": "store_true",
        },
    )

    selection: str = field(
        default="chunks",
        metadata={
            "help": "How a period's history is chosen below budget 1.0: 'chunks' (ContiguousKV: whole chunks "
            "scored on their stored key min/max) or 'impress' (the IMPRESS-style baseline: the period's first "
            "layer reads every history key and keeps each 64-token block holding a token of highest attention "
            "mass; registered by benchmarks/baselines/impress.py where LOOPKV_EXTENSIONS names it).",
            "registry": "sgl_loopkv.cache.chunk_selection:CHUNK_SELECTIONS",
            "baseline": True,
        },
    )
    layer_group: int = field(
        default=0,
        metadata={
            "help": "Layers grouped together in the disk segments this server writes (0: --loopkv-prefix-gate; "
            "1: layer-major, which the 'impress' selection probes). Any server reads any grouping.",
            "baseline": True,
        },
    )
    no_host_cache: bool = field(
        default=False,
        metadata={
            "help": "Do not keep the chunks that chunk-pruned restores read from disk in the host tier's free room "
            "(kept by default, so the next restore of that history reads only what it did not read before).",
            "action": "store_true",
            "baseline": True,
        },
    )

    @property
    def enabled(self) -> bool:
        return self.budget < 1.0 or self.stream

    @property
    def host_cache(self) -> bool:
        return not self.no_host_cache

    @property
    def file_layer_group(self) -> int:
        return self.layer_group or self.gate

    def __post_init__(self):
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"--loopkv-prefix-budget must be in (0, 1], not {self.budget}")
        if not 0.0 <= self.prefetch <= 1.0:
            raise ValueError(f"--loopkv-prefix-prefetch must be in [0, 1], not {self.prefetch}")
        if self.period < 1 or self.gate < 1 or self.local < 1 or self.min_tokens < 0 or self.layer_group < 0:
            raise ValueError("--loopkv-prefix-period, -gate and -local must be >= 1, -min-tokens and -layer-group >= 0")
        selection = Option("prefix", next(f for f in fields(self) if f.name == "selection"), self.flag_prefix)
        if self.selection not in selection.choices():  # the registry's names (the baselines' where loaded)
            raise ValueError(f"--loopkv-prefix-selection: {selection.registry().unknown(self.selection)}")
