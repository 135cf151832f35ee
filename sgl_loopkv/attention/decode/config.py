"""Sparse decode's section of the ``--loopkv-*`` flags (:class:`SparseDecodeConfig`; composed by
:class:`sgl_loopkv.config.LoopKVConfig`, read by the decode policies of this package and the
attention backend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class SparseDecodeConfig:
    """Sparse decode: which pages of a long history each KV head reads per decode step. The defaults are
    the papers' settings scaled to SmolLM2's 8K context."""

    flag_prefix: ClassVar[str] = "decode_"
    title: ClassVar[str] = "sparse decode"

    policy: str = field(
        default="dense",
        metadata={
            "help": "Sparse decode policy for sequences of at least --loopkv-decode-min-context tokens: 'dense' "
            "(off), 'lserve' (page scores from key min/max, reused for --loopkv-decode-reuse steps), 'freekv' "
            "(speculative selection from the previous step's query, corrected below --loopkv-decode-tau) or "
            "'loopserve' (re-selection from the attention of the last --loopkv-decode-n-d generated tokens).",
            "registry": "sgl_loopkv.attention.decode:DECODE_POLICIES",
            "off": "dense",
        },
    )
    budget: int = field(
        default=1024,
        metadata={
            "help": "Tokens each KV head reads per decode step, sink and local window included; at least sink + "
            "local + one page."
        },
    )
    page_size: int = field(
        default=64,
        metadata={"help": "Physical page, in tokens: the unit that is selected and read."},
    )
    logical_page: int = field(
        default=16,
        metadata={"help": "Logical page of the key min/max summaries, in tokens; divides --loopkv-decode-page-size."},
    )
    sink: int = field(
        default=64,
        metadata={"help": "First tokens of the sequence every step reads (attention sink)."},
    )
    local: int = field(
        default=128,
        metadata={"help": "Last tokens every step reads (local window), as well as any generated since a selection."},
    )
    reuse: int = field(
        default=4,
        metadata={"help": "lserve: decode steps one page selection is reused for."},
    )
    tau: float = field(
        default=0.9,
        metadata={
            "help": "freekv: re-select with the current query when its cosine similarity to the previous step's "
            "query falls below this (above 1: every step, non-speculative)."
        },
    )
    n_d: int = field(
        default=16,
        metadata={"help": "loopserve: re-select every this many steps, from the last this many queries."},
    )
    dense_steps: int = field(
        default=16,
        metadata={
            "help": "loopserve: a sequence's first this many decode steps read every key, and its first selection "
            "is made from their queries (0: select at the first step, from its query)."
        },
    )
    min_context: int = field(
        default=2048,
        metadata={"help": "Sequences shorter than this many tokens decode densely."},
    )
    executor: str = field(
        default="auto",
        metadata={
            "help": "Executor of sparse decode plans: 'native' (the CPU kernel), 'reference' (torch), 'triton' or "
            "'flashinfer' (CUDA); 'auto': native on CPU, triton on CUDA.",
            "choices": ["auto", "native", "reference", "triton", "flashinfer"],
        },
    )

    @property
    def enabled(self) -> bool:
        return self.policy != "dense"

    def __post_init__(self):
        if self.page_size < 1 or self.logical_page < 1 or self.page_size % self.logical_page:
            raise ValueError("--loopkv-decode-logical-page must divide --loopkv-decode-page-size (both >= 1)")
        if self.budget < 1 or self.sink < 0 or self.local < 1 or self.reuse < 1 or self.n_d < 1 or self.min_context < 0:
            raise ValueError(
                "--loopkv-decode-budget, -local, -reuse and -n-d must be >= 1, -sink and -min-context >= 0"
            )
        if self.budget < self.sink + self.local + self.page_size:
            raise ValueError(
                f"--loopkv-decode-budget ({self.budget}) must leave at least one page beyond the sink and local "
                f"window ({self.sink} + {self.local} + {self.page_size} tokens)"
            )
