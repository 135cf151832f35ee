"""sgl-loopkv's own settings: the ``--loopkv-*`` flags.

:class:`LoopKVConfig` holds the process-wide fields and one section (a dataclass) per component
family; a component gets its own section, never the whole config (the restore planner gets
:class:`RestoreConfig`, a prefill selection policy :class:`SparsePrefillConfig`). Every field of
every section is a flag: ``--loopkv-`` + the section's ``flag_prefix`` + the field name
(``RestoreConfig.planner`` -> ``--loopkv-restore-planner``); its help text is the field's ``help``
metadata.

A flag that picks a component by name takes its choices from that component's registry
(``registry`` metadata, ``"module:NAME"``, looked up when the parser is built, like a deferred
factory: this module stays below the packages that own the registries), plus an ``off`` value
where the component is optional. ``tests/unit/test_config.py`` checks that every registry has its
flag and every such flag names a registry.

The launcher parses the flags out of argv before SGLang sees the rest, and hands them to SGLang's
subprocesses through one environment variable (JSON), because SGLang has no registry for plugin
arguments and spawned processes inherit the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import pkgutil
from collections.abc import Iterator
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

ENV_VAR = "LOOPKV_CONFIG"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sgl-loopkv``, else ``~/.cache/sgl-loopkv``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sgl-loopkv"


@dataclass(slots=True)
class TierConfig:
    """The loopkv radix cache's host and disk tiers."""

    flag_prefix: ClassVar[str] = ""

    host_bytes: int = field(
        default=2 << 30,
        metadata={"help": "Byte quota of the host-RAM tier of the loopkv radix cache (default 2 GiB).", "type": int},
    )
    disk_dir: str = field(
        default="auto",
        metadata={
            "help": "Directory of the disk tier; reusing it after a restart resumes the stored conversations. "
            "'auto' (default): <cache-dir>/kv; 'none': no disk tier. Several servers (workers of a cluster, "
            "on one machine or on a shared filesystem) may share it: each resumes what the others stored."
        },
    )
    disk_bytes: int = field(
        default=20 << 30,
        metadata={"help": "Byte quota of the disk tier (default 20 GiB).", "type": int},
    )
    disk_free_share: float = field(
        default=0.5,
        metadata={
            "help": "The disk tier's quota never exceeds this share of its filesystem's free space at start-up "
            "(plus what the tier already holds there).",
            "type": float,
        },
    )
    disk_read: str = field(
        default="background",
        metadata={
            "help": "How a returning history that only the disk tier holds is read: 'background' (default: on a "
            "thread while the request waits in the queue, the server's other requests running meanwhile; then it "
            "loads like a host-tier hit) or 'inline' (read and verified inside the scheduler's match, every other "
            "request waiting for it). Chunk-pruned restores (--loopkv-prefix-budget, --loopkv-prefix-stream) read "
            "their own chunks either way.",
            "choices": ["background", "inline"],
        },
    )
    value_policy: str = field(
        default="attention",
        metadata={
            "help": "What the host/disk tiers evict last: 'attention' (attention importance x accesses, "
            "decayed) or 'lru'.",
            "registry": "sgl_loopkv.cache.value:VALUE_POLICIES",
        },
    )
    store_dtype: str = field(
        default="pool",
        metadata={
            "help": "dtype of the KV kept in the host and disk tiers: 'pool' (the KV pool's own, exact) or a "
            "narrower one ('bfloat16', 'float16': half the bytes of an fp32 pool; 'int8': 8-bit values with a "
            "float32 scale per token and KV head; bytes per token: benchmarks/results/store_codecs.md; lossy; "
            "loads decode back).",
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
            raise ValueError("--loopkv-host-bytes and --loopkv-disk-bytes must be >= 0")
        if not 0 < self.disk_free_share <= 1:
            raise ValueError("--loopkv-disk-free-share must be in (0, 1]")


@dataclass(slots=True)
class RestoreConfig:
    """How a returning history is restored (Krul): the planner and its parameters."""

    flag_prefix: ClassVar[str] = "restore_"

    planner: str = field(
        default="krul",
        metadata={
            "help": "How a returning history is restored per layer: 'krul' (recompute/load split chosen from a cost "
            "model calibrated on this machine), 'load_all', 'recompute_all', or 'fixed' (--loopkv-restore-ratio of "
            "the front recomputed in every layer).",
            "registry": "sgl_loopkv.restore.plan:PLANNERS",
        },
    )
    ratio: float = field(
        default=0.4,
        metadata={"help": "Front share recomputed in every layer by the 'fixed' restore planner.", "type": float},
    )


@dataclass(slots=True)
class SharingConfig:
    """Krul's cross-layer sharing of stored KV (defaults chosen in benchmarks/results/krul_select.md)."""

    flag_prefix: ClassVar[str] = "share_"

    layers: str = field(
        default="none",
        metadata={
            "help": "Store paired layers of a finished turn as one row: 'none' (off), 'reuse' (the deep layer reuses "
            "the shallow one's KV) or 'minicache' (SLERP-merged directions, per-token magnitudes, outliers kept).",
            "registry": "sgl_loopkv.krul.codec:CODECS",
            "off": "none",
        },
    )
    gamma: float = field(
        default=0.5,  # 90% of SmolLM2's layers; uniform attention scores 0.2
        metadata={
            "help": "Layers whose initial+recent attention mass reaches this are sharing candidates (Krul's I-R layers).",
            "type": float,
        },
    )
    ratio: float = field(
        default=0.25,  # the largest r_l keeping greedy agreement >= 0.9 on SmolLM2
        metadata={"help": "Share of all layers that may end up in a pair (Krul's r_l).", "type": float},
    )
    pairing: str = field(
        default="optimal",
        metadata={
            "help": "How pairs are picked: 'greedy' (Krul Alg. 1) or 'optimal' (min-distance matching).",
            "registry": "sgl_loopkv.krul.pairing:PAIRINGS",
        },
    )
    stride: int = field(
        default=4,  # 0.25% distance error, same pairs, 1/4 of the exact cost
        metadata={
            "help": "Similarity estimator: count the rows at positions that are multiples of n, prefill and decode (1 = exact).",
            "type": int,
        },
    )

    @property
    def enabled(self) -> bool:
        return self.layers != "none"

    def __post_init__(self):
        if not 0 <= self.gamma <= 1 or not 0 <= self.ratio <= 1 or self.stride < 1:
            raise ValueError("--loopkv-share-gamma/-ratio must be in [0, 1] and --loopkv-share-stride >= 1")


@dataclass(slots=True)
class SparsePrefillConfig:
    """Sparse prefill: the selection policy, its parameters and the executor of its plans."""

    flag_prefix: ClassVar[str] = ""

    prefill_policy: str = field(
        default="dense",
        metadata={
            "help": "Sparse prefill policy for extends longer than --loopkv-sparse-min-len new tokens: 'dense' "
            "(off), 'loopserve' (online vertical/slash lines), 'lserve' (streaming heads), 'block' (block top-mass).",
            "registry": "sgl_loopkv.attention.policies:POLICIES",
            "off": "dense",
        },
    )
    alpha: float = field(
        default=0.95,
        metadata={"help": "Attention-mass coverage of the loopserve and block policies (1 = dense).", "type": float},
    )
    block_size: int = field(
        default=64,
        metadata={"help": "Block size (tokens) of sparse prefill plans.", "type": int},
    )
    sparse_min_len: int = field(
        default=2048,
        metadata={
            "help": "Extends with at most this many new tokens stay dense (decode always does): on CPU a sparse "
            "plan costs more than it saves below a few thousand tokens (the prefill table: "
            "benchmarks/results/prefill.md).",
            "type": int,
        },
    )
    sparse_dense_tail: int = field(
        default=64,
        metadata={
            "help": "loopserve/block: the query blocks holding the last this many new rows attend to every key "
            "(they produce the first token).",
            "type": int,
        },
    )
    sparse_tail_samples: int = field(
        default=16,
        metadata={"help": "loopserve: how many of the 48 sampled rows are the last rows.", "type": int},
    )
    sparse_full_density: float = field(
        default=0.6,
        metadata={
            "help": "loopserve/block: a KV head whose plan reaches this density runs dense (1 = never).",
            "type": float,
        },
    )
    streaming_fraction: float = field(
        default=0.5,
        metadata={"help": "lserve: fraction of (layer, KV head) pairs that stream.", "type": float},
    )
    streaming_sink: int = field(
        default=64,
        metadata={"help": "lserve: sink tokens a streaming head sees (a multiple of the block size).", "type": int},
    )
    streaming_local: int = field(
        default=1024,
        metadata={
            "help": "lserve: tokens before the diagonal block a streaming head sees (a multiple of the block size).",
            "type": int,
        },
    )
    streaming_calibration: str | None = field(
        default=None,
        metadata={
            "help": "lserve: the model's streaming-head calibration JSON (default: the bundled file named after "
            "the model folder; make one with python -m sgl_loopkv.attention.calibration)."
        },
    )
    sparse_executor: str = field(
        default="torch",
        metadata={
            "help": "Executor of sparse prefill plans ('flashinfer' and 'triton' need CUDA).",
            "registry": "sgl_loopkv.attention.sparse:SPARSE_EXECUTORS",
        },
    )

    @property
    def enabled(self) -> bool:
        return self.prefill_policy != "dense"

    def __post_init__(self):
        if not 0 < self.alpha <= 1 or not 0 <= self.streaming_fraction <= 1:
            raise ValueError("--loopkv-alpha must be in (0, 1] and --loopkv-streaming-fraction in [0, 1]")
        if self.block_size < 1 or self.streaming_sink % self.block_size or self.streaming_local % self.block_size:
            raise ValueError("--loopkv-streaming-sink/-local must be multiples of --loopkv-block-size")
        if self.sparse_dense_tail < 0 or self.sparse_tail_samples < 0 or not 0 < self.sparse_full_density <= 1:
            raise ValueError("--loopkv-sparse-dense-tail/-tail-samples must be >= 0, -full-density in (0, 1]")


@dataclass(slots=True)
class SparseDecodeConfig:
    """Sparse decode: which pages of a long history each KV head reads per step (flags
    ``--loopkv-decode-*``). Defaults: the papers' settings scaled to SmolLM2's 8K context
    (README "Sparse decode")."""

    flag_prefix: ClassVar[str] = "decode_"

    policy: str = field(
        default="dense",
        metadata={
            "help": "Sparse decode policy for sequences of at least --loopkv-decode-min-context tokens: 'dense' "
            "(off), 'lserve' (page min/max scores, reused for --loopkv-decode-reuse steps), 'freekv' (speculative "
            "selection from the previous query, corrected below --loopkv-decode-tau), 'loopserve' (re-selection "
            "from the attention of the last --loopkv-decode-n-d generated tokens).",
            "registry": "sgl_loopkv.attention.decode:DECODE_POLICIES",
            "off": "dense",
        },
    )
    budget: int = field(
        default=1024,
        metadata={"help": "Tokens each KV head reads per decode step, sink and local window included.", "type": int},
    )
    page_size: int = field(
        default=64,
        metadata={"help": "Physical page (tokens): the unit selected and read.", "type": int},
    )
    logical_page: int = field(
        default=16,
        metadata={
            "help": "Logical page (tokens) of the key min/max summaries; divides --loopkv-decode-page-size.",
            "type": int,
        },
    )
    sink: int = field(
        default=64,
        metadata={"help": "First tokens every step reads (attention sink).", "type": int},
    )
    local: int = field(
        default=128,
        metadata={
            "help": "Last tokens every step reads (local window; tokens generated since a selection too).",
            "type": int,
        },
    )
    reuse: int = field(
        default=4,
        metadata={"help": "lserve: decode steps one page selection is reused for.", "type": int},
    )
    tau: float = field(
        default=0.9,
        metadata={
            "help": "freekv: re-select with the current query when its cosine similarity to the previous step's "
            "falls below this (> 1: always, i.e. non-speculative).",
            "type": float,
        },
    )
    n_d: int = field(
        default=16,
        metadata={"help": "loopserve: re-select every this many steps from the last this many queries.", "type": int},
    )
    dense_steps: int = field(
        default=16,
        metadata={
            "help": "loopserve: a sequence's first this many decode steps read every key (LoopServe's 'decoding "
            "size' 16), its first selection is made from their queries; 0: select at the first step from its query.",
            "type": int,
        },
    )
    min_context: int = field(
        default=2048,
        metadata={"help": "Sequences shorter than this decode densely.", "type": int},
    )
    executor: str = field(
        default="auto",
        metadata={
            "help": "Executor of sparse decode plans: 'native' (CPU kernel), 'reference' (torch), 'triton' or "
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


@dataclass(slots=True)
class PrefixConfig:
    """Chunk-pruned re-prefill (ContiguousKV): a returning history is loaded chunk by chunk, only
    the chunks the new turn's queries need, selected once per period of layers."""

    flag_prefix: ClassVar[str] = "prefix_"

    budget: float = field(
        default=1.0,
        metadata={
            "help": "Fraction of a returning history's 16-token chunks the new turn attends to (rounded up to whole "
            "chunks; the first chunk and the --loopkv-prefix-local nearest ones always among them). 1.0: every "
            "chunk, exactly as a full load (streamed with --loopkv-prefix-stream). On SmolLM2 answers hold at 0.9; "
            "lower budgets restore faster and cost answers (benchmarks/results/reprefill.md).",
            "type": float,
        },
    )
    period: int = field(
        default=8,
        metadata={
            "help": "Layers one chunk selection is reused for (selected at the period's first layer).",
            "type": int,
        },
    )
    gate: int = field(
        default=4,
        metadata={
            "help": "Layers of a period whose reads a layer's compute waits for together (sub-period gate); also "
            "the layer grouping of the disk segments this server writes unless --loopkv-prefix-layer-group says "
            "otherwise.",
            "type": int,
        },
    )
    local: int = field(
        default=4,
        metadata={"help": "Chunks nearest the new turn always kept.", "type": int},
    )
    prefetch: float = field(
        default=0.0,
        metadata={
            "help": "Share of a period's selected chunks read ahead for the next period before its own selection "
            "(ContiguousKV's inter-period prefetch): the first and nearest chunks (always kept) and then the "
            "best scored ones. 1.0: the whole set (the paper); lower: fewer bytes read for nothing when consecutive "
            "periods choose differently, less I/O hidden behind compute; 0 (default, measured best on SmolLM2: "
            "consecutive periods share half their chunks, benchmarks/results/NOTES.md): only the always-kept chunks. "
            "Never fewer than two sets of the budget's size must share (2 x kept - chunks: none up to budget 0.5).",
            "type": float,
        },
    )
    min_tokens: int = field(
        default=1024,
        metadata={"help": "Histories shorter than this are loaded whole (pruning saves nothing there).", "type": int},
    )
    stream: bool = field(
        default=False,
        metadata={
            "help": "At budget 1.0 too, restore a returning history chunk by chunk: a disk hit is admitted from its "
            "header and its chunks read period by period during the new turn's prefill, each extent verified before "
            "use (default at 1.0: the history is read and verified whole, then copied layer by layer, with the "
            "restore planner's front recompute).",
            "action": "store_true",
        },
    )

    selection: str = field(
        default="chunks",
        metadata={
            "help": "How a period's history is chosen under a budget below 1.0. chunks (default, ContiguousKV): whole "
            "16-token chunks scored on their stored key min/max, no key read. impress: the baseline ContiguousKV "
            "compares with (IMPRESS-style): the period's first layer reads every history key (a synchronous probe), "
            "keeps the tokens of highest exact attention mass and reads every 64-token block holding one; its page "
            "cache holds the whole history (a benchmark baseline, not a mode to serve with).",
            "choices": ["chunks", "impress"],
        },
    )
    layer_group: int = field(
        default=0,
        metadata={
            "help": "Layers grouped together in the disk segments this server writes (0: --loopkv-prefix-gate): a "
            "chunk's extents of a group's layers are adjacent, so a chunk-pruned restore reads a run of selected "
            "chunks for a whole gate at once. 1: layer-major (one layer's whole history contiguous: what "
            "--loopkv-prefix-selection impress probes). Any server reads any grouping.",
            "type": int,
        },
    )
    no_host_cache: bool = field(
        default=False,
        metadata={
            "help": "Do not keep the chunks that chunk-pruned restores read from disk in the host arena's free room "
            "(default: kept, the least valuable by attention importance x accesses evicted first, so the next "
            "restore of that history reads only what it did not select before).",
            "action": "store_true",
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
        if self.selection not in ("chunks", "impress"):
            raise ValueError(f"--loopkv-prefix-selection must be chunks or impress, not {self.selection!r}")
        if self.period < 1 or self.gate < 1 or self.local < 1 or self.min_tokens < 0 or self.layer_group < 0:
            raise ValueError("--loopkv-prefix-period, -gate and -local must be >= 1, -min-tokens and -layer-group >= 0")


@dataclass(slots=True)
class LimitsConfig:
    """What one request may ask of the server, and how long a stopping server waits for requests.

    Applied only to servers started through ``python -m sgl_loopkv.launch_server``: the plugin leaves
    a plain ``sglang.launch_server`` as SGLang made it (:mod:`sgl_loopkv.server.limits`)."""

    flag_prefix: ClassVar[str] = ""

    max_n: int = field(
        default=8,
        metadata={
            "help": "Largest number of choices (OpenAI 'n', sampling 'n') one request may ask for; more gets a 400.",
            "type": int,
        },
    )
    default_max_tokens: int = field(
        default=1024,
        metadata={
            "help": "Tokens generated for a request that sets no max_tokens / max_new_tokens (SGLang would "
            "generate up to the whole context). A request may still ask for more, up to the context length.",
            "type": int,
        },
    )
    max_client_requests: int = field(
        default=64,
        metadata={
            "help": "Requests one client address may have in flight at once (streams count until they end); "
            "more get a 429. 0: no limit. Behind a router every request comes from the router's address: "
            "raise it or set 0 there.",
            "type": int,
        },
    )
    shutdown_grace_s: float = field(
        default=30.0,
        metadata={
            "help": "After SIGTERM, seconds the server lets running requests finish before it aborts them "
            "and exits (SGLang alone waits for every queued request).",
            "type": float,
        },
    )

    def __post_init__(self):
        if self.max_n < 1 or self.default_max_tokens < 1 or self.shutdown_grace_s < 0 or self.max_client_requests < 0:
            raise ValueError(
                "--loopkv-max-n and --loopkv-default-max-tokens must be >= 1, --loopkv-shutdown-grace-s and "
                "--loopkv-max-client-requests >= 0"
            )


# --- stored conversations' lifecycle (issue 55): retention, forget, encryption --------------------
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

    flag_prefix: ClassVar[str] = ""

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

    @property
    def disk_ttl_s(self) -> float | None:
        return parse_duration(self.disk_ttl, "--loopkv-disk-ttl")

    def __post_init__(self):
        parse_duration(self.disk_ttl, "--loopkv-disk-ttl")  # a clear error at start-up, not a silent default


#: section field of LoopKVConfig -> its dataclass
SECTIONS: dict[str, type] = {
    "tiers": TierConfig,
    "restore": RestoreConfig,
    "sharing": SharingConfig,
    "sparse": SparsePrefillConfig,
    "decode": SparseDecodeConfig,
    "prefix": PrefixConfig,
    "limits": LimitsConfig,
    "lifecycle": LifecycleConfig,
}


@dataclass(frozen=True, slots=True)
class Option:
    """One flag: ``section`` (None = a top-level field) and the dataclass field behind it."""

    section: str | None
    field: Field
    prefix: str = ""

    @property
    def name(self) -> str:
        """The flag without ``--loopkv-``, snake_case (``restore_planner``); also the argparse dest suffix."""
        return self.prefix + self.field.name

    @property
    def flag(self) -> str:
        return "--loopkv-" + self.name.replace("_", "-")

    def choices(self) -> list[str] | None:
        """The registry's names (plus the ``off`` value first), or the literal ``choices``."""
        meta = self.field.metadata
        if "registry" in meta:
            registry = pkgutil.resolve_name(meta["registry"])
            return ([meta["off"]] if "off" in meta else []) + registry.names()
        return meta.get("choices")


@dataclass(slots=True)
class LoopKVConfig:
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory for sgl-loopkv's caches, e.g. the converted default model "
            "(default: $XDG_CACHE_HOME/sgl-loopkv or ~/.cache/sgl-loopkv)."
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "Serve on 'cpu' or 'cuda'; 'auto' picks cuda when a GPU is visible.",
            "choices": ["auto", "cpu", "cuda"],
        },
    )
    attention_executor: str = field(
        default="torch",
        metadata={
            "help": "Executor that runs the loopkv attention backend's plans.",
            "registry": "sgl_loopkv.attention.executor:EXECUTORS",
        },
    )
    stock: bool = field(
        default=False,
        metadata={
            "help": "Serve with none of sgl-loopkv's components (SGLang's own attention and radix cache): "
            "the baseline the benchmarks compare against.",
            "action": "store_true",
        },
    )
    tiers: TierConfig = field(default_factory=TierConfig)
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    sparse: SparsePrefillConfig = field(default_factory=SparsePrefillConfig)
    decode: SparseDecodeConfig = field(default_factory=SparseDecodeConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--loopkv-device must be auto, cpu or cuda, not {self.device!r}")
        if self.tiers.disk_dir == "auto":  # resolved here, so the subprocesses get the launcher's path
            self.tiers.disk_dir = str(self.resolved_cache_dir / "kv")

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    # --- flags ----------------------------------------------------------------------------------
    @classmethod
    def options(cls) -> Iterator[Option]:
        """Every flag, in help order: the top-level fields, then each section's."""
        for f in fields(cls):
            if f.name in SECTIONS:
                section = SECTIONS[f.name]
                for sf in fields(section):
                    yield Option(f.name, sf, section.flag_prefix)
            else:
                yield Option(None, f)

    @classmethod
    def option_names(cls) -> set[str]:
        return {o.name for o in cls.options()}

    @staticmethod
    def flag(name: str) -> str:
        return "--loopkv-" + name.replace("_", "-")

    @classmethod
    def from_flat(cls, **values: Any) -> LoopKVConfig:
        """A config from option names (``restore_planner=...``, as the flags spell them)."""
        unknown = set(values) - cls.option_names()
        if unknown:
            raise TypeError(f"unknown sgl-loopkv options {sorted(unknown)}")
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for o in cls.options():
            if o.name in values:
                (sections[o.section] if o.section else top)[o.field.name] = values[o.name]
        return cls(**top, **{name: SECTIONS[name](**kw) for name, kw in sections.items()})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sgl-loopkv")
        for o in cls.options():
            kwargs = {"default": o.field.default, "help": o.field.metadata["help"], "dest": f"loopkv_{o.name}"}
            for opt in ("type", "action"):
                if opt in o.field.metadata:
                    kwargs[opt] = o.field.metadata[opt]
            choices = o.choices()
            if choices is not None:
                kwargs["choices"] = choices
            group.add_argument(o.flag, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> LoopKVConfig:
        return cls.from_flat(**{o.name: getattr(ns, f"loopkv_{o.name}") for o in cls.options()})

    # --- hand-over to SGLang's subprocesses -------------------------------------------------------
    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @staticmethod
    def launched() -> bool:
        """True in the processes of a server started by sgl-loopkv's launcher (it sets the variable)."""
        return bool(os.environ.get(ENV_VAR))

    @classmethod
    def from_env(cls) -> LoopKVConfig:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(**{k: SECTIONS[k](**v) if k in SECTIONS else v for k, v in data.items()})
