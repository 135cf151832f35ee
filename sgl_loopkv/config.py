"""sgl-loopkv's own settings: the ``--loopkv-*`` flags.

:class:`LoopKVConfig` holds the process-wide fields and one section (a dataclass) per component
family; a component gets its own section, never the whole config (the restore planner gets
:class:`RestoreConfig`, a prefill selection policy :class:`SparsePrefillConfig`). Every field of
every section is a flag: ``--loopkv-`` + the section's ``flag_prefix`` + the field name
(``RestoreConfig.planner`` -> ``--loopkv-restore-planner``). Its argparse type comes from the
annotation (``Bytes`` for a byte quota: it takes units), its help from the ``help`` metadata (one or
two sentences: what it does, units, when to use it; the why goes on the mechanism's docs page), and
:mod:`sgl_loopkv.flags` says what else a field may declare (``metavar``, ``default_text``,
``baseline`` for a flag only benchmarks use). Each section is one group of ``--help`` and of
``docs/configuration.md`` (generated: ``python -m sgl_loopkv.server.config_docs --write``).

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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from sgl_loopkv.flags import Bytes, Option

ENV_VAR = "LOOPKV_CONFIG"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sgl-loopkv``, else ``~/.cache/sgl-loopkv``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sgl-loopkv"


@dataclass(slots=True)
class TierConfig:
    """The loopkv radix cache's host and disk tiers: where conversations evicted from the KV pool are
    kept, and what survives a restart."""

    flag_prefix: ClassVar[str] = ""
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
            raise ValueError("--loopkv-host-bytes and --loopkv-disk-bytes must be >= 0")
        if not 0 < self.disk_free_share <= 1:
            raise ValueError("--loopkv-disk-free-share must be in (0, 1]")


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


@dataclass(slots=True)
class SparsePrefillConfig:
    """Sparse prefill: which keys each query block of a long extend attends to, and what computes it."""

    flag_prefix: ClassVar[str] = ""
    title: ClassVar[str] = "sparse prefill"

    prefill_policy: str = field(
        default="dense",
        metadata={
            "help": "Sparse prefill policy for extends of more than --loopkv-sparse-min-len new tokens: 'dense' "
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
    sparse_min_len: int = field(
        default=2048,
        metadata={"help": "Extends of at most this many new tokens stay dense (decode always does)."},
    )
    sparse_dense_tail: int = field(
        default=64,
        metadata={
            "help": "loopserve and block: the query blocks holding the last this many new tokens attend to every "
            "key (they produce the first output token)."
        },
    )
    sparse_tail_samples: int = field(
        default=16,
        metadata={"help": "loopserve: how many of the 48 sampled query rows are the extend's last rows."},
    )
    sparse_full_density: float = field(
        default=0.6,
        metadata={"help": "loopserve and block: a KV head whose plan reaches this density runs dense (1: never)."},
    )
    streaming_fraction: float = field(
        default=0.5,
        metadata={"help": "lserve: share of (layer, KV head) pairs, in [0, 1], that are streaming heads."},
    )
    streaming_sink: int = field(
        default=64,
        metadata={"help": "lserve: first tokens a streaming head attends to; a multiple of --loopkv-block-size."},
    )
    streaming_local: int = field(
        default=1024,
        metadata={
            "help": "lserve: tokens before the diagonal block a streaming head attends to; a multiple of "
            "--loopkv-block-size."
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
    sparse_executor: str = field(
        default="torch",
        metadata={
            "help": "Executor of sparse prefill plans: 'torch' (any device); 'flashinfer' and 'triton' need CUDA.",
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


@dataclass(slots=True)
class LimitsConfig:
    """What one request may ask of the server, and how long a stopping server waits for requests; only in
    servers started by this launcher.

    A plain ``sglang.launch_server`` stays as SGLang made it (:mod:`sgl_loopkv.server.limits`)."""

    flag_prefix: ClassVar[str] = ""
    title: ClassVar[str] = "request limits"

    max_n: int = field(
        default=8,
        metadata={"help": "Most choices (OpenAI 'n', sampling 'n') one request may ask for; more gets HTTP 400."},
    )
    default_max_tokens: int = field(
        default=1024,
        metadata={
            "help": "Tokens generated for a request that sets no max_tokens or max_new_tokens (SGLang alone would "
            "generate up to the context length); a request may still ask for more, up to the context length."
        },
    )
    max_client_requests: int = field(
        default=64,
        metadata={
            "help": "Requests one client address may have in flight at once (a stream counts until it ends); more "
            "get HTTP 429 (0: no limit). Behind a router every request comes from the router's address: raise it "
            "or set 0 there."
        },
    )
    shutdown_grace_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a server lets running requests finish after SIGTERM before it aborts them and exits "
            "(SGLang alone waits for every queued request)."
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

    title: ClassVar[str] = "retention and isolation"
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
        return parse_duration(self.disk_ttl, "--loopkv-disk-ttl")

    def __post_init__(self):
        parse_duration(self.disk_ttl, "--loopkv-disk-ttl")  # a clear error at start-up, not a silent default
        if self.pin_bytes < 0:
            raise ValueError(f"--loopkv-pin-bytes must be >= 0, got {self.pin_bytes}")
        for name in ("tenant_host_share", "tenant_disk_share"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"--loopkv-{name.replace('_', '-')} must be in (0, 1], got {value}")


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


@dataclass(slots=True)
class LoopKVConfig:
    """Where sgl-loopkv keeps its files, which device it serves on, and what computes its attention."""

    title: ClassVar[str] = "files and device"
    baselines: ClassVar[str] = (
        "Flags only the benchmarks use, to measure a mechanism against its baseline or with a part of it off; "
        "not meant for serving."
    )

    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory of sgl-loopkv's own files: the converted default model and, with "
            "--loopkv-disk-dir auto, the disk tier.",
            "metavar": "DIR",
            "default_text": "$XDG_CACHE_HOME/sgl-loopkv, else ~/.cache/sgl-loopkv",
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
            "help": "Executor that computes the loopkv attention backend's plans.",
            "registry": "sgl_loopkv.attention.executor:EXECUTORS",
        },
    )
    weights: str = field(
        default="float32",
        metadata={
            "help": "What the linear layers and the embedding of the embedded default model compute from on the CPU: "
            "'float32' (default): the converted float weights, as stock SGLang; 'gguf': the blocks of its GGUF file "
            "(Q4_1, Q8_0 embedding), no float copy kept (docs/models.md). 'gguf' needs the CPU; a --model-path "
            "that is a GGUF file is always served from its blocks.",
            "choices": ["float32", "gguf"],
        },
    )
    stock: bool = field(
        default=False,
        metadata={
            "help": "Serve with none of sgl-loopkv's components (SGLang's own attention and radix cache, the same "
            "dtype): the baseline the benchmarks compare against.",
            "action": "store_true",
            "baseline": True,
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
        if self.weights not in ("float32", "gguf"):
            raise ValueError(f"--loopkv-weights must be float32 or gguf, not {self.weights!r}")
        if self.weights == "gguf" and self.stock:
            raise ValueError("--loopkv-weights gguf is not stock SGLang: it cannot go with --loopkv-stock")
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
        """One argument group per section (in :meth:`options` order), the benchmark baselines last."""
        groups: dict[str | None, Any] = {}
        for o in sorted(cls.options(), key=lambda o: o.baseline):  # stable: the baselines after the rest
            key = "baselines" if o.baseline else o.section
            if key not in groups:
                owner = SECTIONS.get(o.section, cls)
                title, doc = ("benchmark baselines", cls.baselines) if o.baseline else (owner.title, owner.__doc__)
                groups[key] = parser.add_argument_group(f"sgl-loopkv {title}", " ".join(doc.split("\n\n")[0].split()))
            groups[key].add_argument(o.flag, **o.argparse_kwargs())

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> LoopKVConfig:
        return cls.from_flat(**{o.name: getattr(ns, o.dest) for o in cls.options()})

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
