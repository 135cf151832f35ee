"""Sparse prefill's section of the ``--loopkv-*`` flags (:class:`SparsePrefillConfig`; composed by
:class:`sgl_loopkv.config.LoopKVConfig`, read by the selection policies of this package and the
attention backend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class SparsePrefillConfig:
    """Sparse prefill: which keys each query block of a long extend attends to, and what computes it."""

    flag_prefix: ClassVar[str] = "prefill_"
    title: ClassVar[str] = "sparse prefill"

    policy: str = field(
        default="dense",
        metadata={
            "help": "Sparse prefill policy for extends of more than --loopkv-prefill-min-len new tokens: 'dense' "
            "(off), 'loopserve' (online vertical and slash lines), 'lserve' (streaming heads) or 'block' (block "
            "top-mass).",
            "registry": "sgl_loopkv.attention.policies:POLICIES",
            "off": "dense",
        },
    )
    alpha: float = field(
        default=0.95,
        metadata={"help": "Share of attention mass, in (0, 1], the loopserve and block plans cover (1: dense)."},
    )
    block_size: int = field(
        default=64,
        metadata={"help": "Block size of sparse prefill plans, in tokens."},
    )
    min_len: int = field(
        default=2048,
        metadata={"help": "Extends of at most this many new tokens stay dense (decode always does)."},
    )
    dense_tail: int = field(
        default=64,
        metadata={
            "help": "loopserve and block: the query blocks holding the last this many new tokens attend to every "
            "key (they produce the first output token)."
        },
    )
    tail_samples: int = field(
        default=16,
        metadata={"help": "loopserve: how many of the 48 sampled query rows are the extend's last rows."},
    )
    full_density: float = field(
        default=0.6,
        metadata={"help": "loopserve and block: a KV head whose plan reaches this density runs dense (1: never)."},
    )
    streaming_fraction: float = field(
        default=0.5,
        metadata={"help": "lserve: share of (layer, KV head) pairs, in [0, 1], that are streaming heads."},
    )
    streaming_sink: int = field(
        default=64,
        metadata={
            "help": "lserve: first tokens a streaming head attends to; a multiple of --loopkv-prefill-block-size."
        },
    )
    streaming_local: int = field(
        default=1024,
        metadata={
            "help": "lserve: tokens before the diagonal block a streaming head attends to; a multiple of "
            "--loopkv-prefill-block-size."
        },
    )
    streaming_calibration: str | None = field(
        default=None,
        metadata={
            "help": "lserve: the model's streaming-head calibration JSON; make one with "
            "python -m sgl_loopkv.attention.calibration.",
            "metavar": "FILE",
            "default_text": "the bundled file named after the model folder",
        },
    )
    executor: str = field(
        default="torch",
        metadata={
            "help": "Executor of sparse prefill plans: 'torch' (any device); 'flashinfer' and 'triton' need CUDA.",
            "registry": "sgl_loopkv.attention.sparse:SPARSE_EXECUTORS",
        },
    )

    @property
    def enabled(self) -> bool:
        return self.policy != "dense"

    def __post_init__(self):
        if not 0 < self.alpha <= 1 or not 0 <= self.streaming_fraction <= 1:
            raise ValueError("--loopkv-prefill-alpha must be in (0, 1], --loopkv-prefill-streaming-fraction in [0, 1]")
        if self.block_size < 1 or self.streaming_sink % self.block_size or self.streaming_local % self.block_size:
            raise ValueError("--loopkv-prefill-streaming-sink/-local must be multiples of --loopkv-prefill-block-size")
        if self.dense_tail < 0 or self.tail_samples < 0 or not 0 < self.full_density <= 1:
            raise ValueError("--loopkv-prefill-dense-tail/-tail-samples must be >= 0, -full-density in (0, 1]")
