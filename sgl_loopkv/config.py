"""sgl-loopkv's own settings: the ``--loopkv-*`` flags.

:class:`LoopKVConfig` holds the process-wide fields and one section (a dataclass) per component
family; a component gets its own section, never the whole config (the restore planner gets
:class:`~sgl_loopkv.restore.config.RestoreConfig`, a prefill selection policy
:class:`~sgl_loopkv.attention.policies.config.SparsePrefillConfig`). Every field of every section is a
flag: ``--loopkv-`` + the section's ``flag_prefix`` (one per section) + the field name
(``RestoreConfig.planner`` -> ``--loopkv-restore-planner``). Its argparse type comes from the annotation
(``Bytes`` for a byte quota: it takes units), its help from the ``help`` metadata (one or two sentences:
what it does, units, when to use it; the why goes on the mechanism's docs page), and
:mod:`sgl_loopkv.flags` says what else a field may declare (``metavar``, ``default_text``, ``baseline`` for
a flag only benchmarks use). Each section is one group of ``--help`` and of ``docs/configuration.md`` (generated:
``python -m sgl_loopkv.server.config_docs --write``). A renamed flag keeps its old name as a hidden alias
(:data:`RENAMED`).

A section lives in the package of the feature that reads it: :data:`SECTIONS` names it as
``"module:Class"`` and :func:`sections` imports it when a config is first built, as a flag that picks a
component by name looks up its registry when the parser is built (``registry`` metadata, plus an ``off``
value where the component is optional): this module stays below those packages (the layers of
``lint-imports``).
``tests/unit/test_config.py`` checks that every registry has its flag and every such flag names a
registry.

The launcher parses the flags out of argv before SGLang sees the rest, and hands them to SGLang's
subprocesses through one environment variable (JSON), because SGLang has no registry for plugin
arguments and spawned processes inherit the environment.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pkgutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from sgl_loopkv.flags import Option
from sgl_loopkv.paths import default_cache_dir

if TYPE_CHECKING:
    from sgl_loopkv.attention.decode.config import SparseDecodeConfig
    from sgl_loopkv.attention.policies.config import SparsePrefillConfig
    from sgl_loopkv.cache.lifecycle_config import LifecycleConfig
    from sgl_loopkv.cache.prefix_config import PrefixConfig
    from sgl_loopkv.cache.tier_config import TierConfig
    from sgl_loopkv.krul.config import SharingConfig
    from sgl_loopkv.restore.config import RestoreConfig
    from sgl_loopkv.server.limits import LimitsConfig

ENV_VAR = "LOOPKV_CONFIG"

#: section field of :class:`LoopKVConfig` -> ``"module:Class"`` of its dataclass, in flag order
SECTIONS: dict[str, str] = {
    "tiers": "sgl_loopkv.cache.tier_config:TierConfig",
    "restore": "sgl_loopkv.restore.config:RestoreConfig",
    "sharing": "sgl_loopkv.krul.config:SharingConfig",
    "sparse": "sgl_loopkv.attention.policies.config:SparsePrefillConfig",
    "decode": "sgl_loopkv.attention.decode.config:SparseDecodeConfig",
    "prefix": "sgl_loopkv.cache.prefix_config:PrefixConfig",
    "limits": "sgl_loopkv.server.limits:LimitsConfig",
    "lifecycle": "sgl_loopkv.cache.lifecycle_config:LifecycleConfig",
}


#: old option name -> its name since each section got one flag prefix (issue 54): the old flags still parse
#: (hidden from ``--help`` and the docs) and :meth:`LoopKVConfig.from_flat` takes the old names, so scripts
#: written before keep working.
RENAMED: dict[str, str] = {
    "host_bytes": "tier_host_bytes",
    "disk_dir": "tier_disk_dir",
    "disk_bytes": "tier_disk_bytes",
    "disk_free_share": "tier_disk_free_share",
    "disk_read": "tier_disk_read",
    "value_policy": "tier_value_policy",
    "store_dtype": "tier_store_dtype",
    "alpha": "prefill_alpha",
    "block_size": "prefill_block_size",
    "streaming_fraction": "prefill_streaming_fraction",
    "streaming_sink": "prefill_streaming_sink",
    "streaming_local": "prefill_streaming_local",
    "streaming_calibration": "prefill_streaming_calibration",
    "sparse_min_len": "prefill_min_len",
    "sparse_dense_tail": "prefill_dense_tail",
    "sparse_tail_samples": "prefill_tail_samples",
    "sparse_full_density": "prefill_full_density",
    "sparse_executor": "prefill_executor",
    "max_n": "limit_max_n",
    "default_max_tokens": "limit_default_max_tokens",
    "max_client_requests": "limit_max_client_requests",
    "shutdown_grace_s": "limit_shutdown_grace_s",
    "disk_ttl": "lifecycle_disk_ttl",
    "require_salt": "lifecycle_require_salt",
    "pin_bytes": "lifecycle_pin_bytes",
    "tenant_host_share": "lifecycle_tenant_host_share",
    "tenant_disk_share": "lifecycle_tenant_disk_share",
    "disk_key_file": "lifecycle_disk_key_file",
}


@functools.cache
def sections() -> dict[str, type]:
    """Section field -> its dataclass (imports the sections' modules: call it where a config is built)."""
    return {name: pkgutil.resolve_name(ref) for name, ref in SECTIONS.items()}


def section(name: str) -> Any:
    """The field of :class:`LoopKVConfig` that holds section ``name``, defaulting to the section's defaults."""
    return field(default_factory=lambda: sections()[name]())


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
            "--loopkv-tier-disk-dir auto, the disk tier.",
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
        default="auto",
        metadata={
            "help": "What the linear layers and the embedding compute from on the CPU. 'auto' (default): a GGUF "
            "--model-path, and the embedded default model when no --model-path is given, from the file's blocks "
            "(no float copy kept, a bfloat16 KV pool; docs/models.md); a Hugging Face folder from its float "
            "weights. 'float32': the default model converted to float32 weights, as stock SGLang serves it (the "
            "exact comparison). 'gguf': the blocks, also for the default model's float32 conversion as a "
            "--model-path. 'gguf' needs the CPU; a GPU start serves float weights.",
            "choices": ["auto", "float32", "gguf"],
        },
    )
    gguf_activations: str = field(
        default="float32",
        metadata={
            "help": "What a GGUF block weight multiplies in a decode step or short extend (up to 16 rows): "
            "'float32' (default): the float32 activations against the exactly dequantized weights, bit for bit "
            "the dequantized float32 model; 'q8': the activations rounded to int8 per 32-element block and "
            "integer block dot products, as llama.cpp does (less work per weight, little gain from memory; below "
            "the fidelity bar on the default model, docs/models.md).",
            "choices": ["q8", "float32"],
        },
    )
    prefill_dtype: str = field(
        default="auto",
        metadata={
            "help": "The matrix arithmetic of a prefill or long extend on GGUF weights: 'bfloat16': its linear "
            "layers (17 new rows or more) on x and weights rounded to bfloat16 with float32 sums, its attention "
            "(64 rows or more) over the bfloat16 KV pool with float32 queries split in two bfloat16 parts and the "
            "softmax weights as --loopkv-prefill-softmax says (oneDNN: faster with AMX-BF16 or AVX512-BF16, slower "
            "without them; within the fidelity bar "
            "against the float32 model, docs/models.md); 'float32': the dequantized model's arithmetic; "
            "'auto' (default): bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, float32 elsewhere. Decode steps and short "
            "extends are float32 either way; the float32 path ignores this flag.",
            "choices": ["auto", "float32", "bfloat16"],
        },
    )
    prefill_softmax: str = field(
        default="split",
        metadata={
            "help": "A bfloat16 prefill's softmax weights in its attention's P V product: 'split' (default): two "
            "bfloat16 parts, close to float32; 'bfloat16': rounded to bfloat16 once, as FlashAttention does on "
            "GPUs (half the P V products, a fifth less attention time; the normalizer stays the float32 sum; it "
            "lost a multi-turn answer the float32 model gets right, docs/models.md). Only --loopkv-prefill-dtype "
            "bfloat16 (or auto on a CPU that takes it) reads it.",
            "choices": ["bfloat16", "split"],
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
    tiers: TierConfig = section("tiers")
    restore: RestoreConfig = section("restore")
    sharing: SharingConfig = section("sharing")
    sparse: SparsePrefillConfig = section("sparse")
    decode: SparseDecodeConfig = section("decode")
    prefix: PrefixConfig = section("prefix")
    limits: LimitsConfig = section("limits")
    lifecycle: LifecycleConfig = section("lifecycle")

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--loopkv-device must be auto, cpu or cuda, not {self.device!r}")
        if self.weights not in ("auto", "float32", "gguf"):
            raise ValueError(f"--loopkv-weights must be auto, float32 or gguf, not {self.weights!r}")
        if self.gguf_activations not in ("q8", "float32"):
            raise ValueError(f"--loopkv-gguf-activations must be q8 or float32, not {self.gguf_activations!r}")
        if self.prefill_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--loopkv-prefill-dtype must be auto, float32 or bfloat16, not {self.prefill_dtype!r}")
        if self.prefill_softmax not in ("bfloat16", "split"):
            raise ValueError(f"--loopkv-prefill-softmax must be bfloat16 or split, not {self.prefill_softmax!r}")
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
                owner = sections()[f.name]
                for sf in fields(owner):
                    yield Option(f.name, sf, owner.flag_prefix)
            else:
                yield Option(None, f)

    @classmethod
    def option_names(cls) -> set[str]:
        return {o.name for o in cls.options()}

    @staticmethod
    def flag(name: str) -> str:
        return "--loopkv-" + name.replace("_", "-")

    @classmethod
    def spellings(cls, flag: str) -> list[str]:
        """``flag`` and its old names (:data:`RENAMED`): what to look for in an argv that may predate it."""
        return [flag, *(cls.flag(old) for old, new in RENAMED.items() if cls.flag(new) == flag)]

    @classmethod
    def from_flat(cls, **given: Any) -> LoopKVConfig:
        """A config from option names (``restore_planner=...``, as the flags spell them; old names too)."""
        values = {RENAMED.get(k, k): v for k, v in given.items()}
        if len(values) < len(given):
            raise TypeError(f"an sgl-loopkv option given under its old and new name: {sorted(given)}")
        unknown = set(values) - cls.option_names()
        if unknown:
            raise TypeError(f"unknown sgl-loopkv options {sorted(unknown)}")
        top: dict[str, Any] = {}
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for o in cls.options():
            if o.name in values:
                (by_section[o.section] if o.section else top)[o.field.name] = values[o.name]
        return cls(**top, **{name: sections()[name](**kw) for name, kw in by_section.items()})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One argument group per section (in :meth:`options` order), the benchmark baselines last."""
        groups: dict[str | None, Any] = {}
        for o in sorted(cls.options(), key=lambda o: o.baseline):  # stable: the baselines after the rest
            key = "baselines" if o.baseline else o.section
            if key not in groups:
                owner = sections().get(o.section, cls)
                title, doc = ("benchmark baselines", cls.baselines) if o.baseline else (owner.title, owner.__doc__)
                groups[key] = parser.add_argument_group(f"sgl-loopkv {title}", " ".join(doc.split("\n\n")[0].split()))
            kwargs = o.argparse_kwargs()
            groups[key].add_argument(o.flag, **kwargs)
            for old in cls.spellings(o.flag)[1:]:  # hidden; SUPPRESS: the new flag's default stands
                groups[key].add_argument(old, **kwargs | {"help": argparse.SUPPRESS, "default": argparse.SUPPRESS})

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
        return cls(**{k: sections()[k](**v) if k in SECTIONS else v for k, v in data.items()})
