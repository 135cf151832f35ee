"""The state sgl-loopkv's components share inside one process, in one typed, set-once object
(mini-sglang's ``Context``), instead of module globals that one factory sets and another reads.

Who writes what (all in the scheduler process; SGLang builds the attention backend before the
radix cache, but nothing here depends on that order):

- :func:`sgl_loopkv.plugin.register` sets the context once per process, with the two boards the
  attention writes during a forward and the cache reads at a turn's end;
- the ``loopkv`` attention factory fills ``layer_stack`` (partial recompute needs the served
  model's layers; with any other attention backend it stays None and restores load everything);
- the ``loopkv`` radix-cache factory fills ``cache`` (the tier report hook reads it).

Layer-wise loads need no entry here: the cache registers its loader as the KV pool's layer
transfer counter, which SGLang's ``get_key_buffer`` waits on for every attention backend.

Reading the context before it is set, or setting it twice, is an error; tests that need a fresh one
call :func:`reset_context` first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the types only: this module sits below the packages whose objects it holds
    from sgl_loopkv.cache.importance import ChunkImportance
    from sgl_loopkv.cache.pruned import PrunedRestore
    from sgl_loopkv.krul.observer import KrulObserver
    from sgl_loopkv.restore.recompute import LayerStack


class TieredCache(Protocol):
    """What the rest of the process reads of the tiered radix cache (``LoopKVRadixCache``) through
    the context: the attention backend its chunk-pruned restores, the response hook its per-tier
    report, the forget endpoint its namespaces. Anything else of the cache is the cache package's."""

    worker_id: str
    pruned: Mapping[str, PrunedRestore]  # rid -> its chunk-pruned restore, while one runs

    def pruned_job(self, rid: str) -> PrunedRestore | None: ...

    def tier_breakdown(self, rid: str, cached_tokens: int) -> dict: ...

    def namespace_root(self, extra_key: str | None, cache_salt: str | None) -> bytes: ...


@dataclass(slots=True, eq=False)
class Context:
    importance: ChunkImportance  # chunk attention mass: the attention records, the cache pops at turn end
    observer: KrulObserver  # layer-sharing statistics (Krul): the attention records, the cache pops
    layer_stack: Callable[[], LayerStack | None] | None = None  # set by the loopkv attention factory
    cache: TieredCache | None = None  # the LoopKVRadixCache of this scheduler process, set by its factory


_CONTEXT: Context | None = None


def set_context(ctx: Context) -> None:
    global _CONTEXT
    if _CONTEXT is not None:
        raise RuntimeError("the sgl-loopkv context is already set in this process (tests: reset_context() first)")
    _CONTEXT = ctx


def get_context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError(
            "the sgl-loopkv context is not set in this process: sgl_loopkv.plugin.register() sets it "
            "(SGLang calls it through its plugin entry point)"
        )
    return _CONTEXT


def has_context() -> bool:
    return _CONTEXT is not None


def reset_context() -> None:
    """Forget the context (tests only: a process serves with one context for its lifetime)."""
    global _CONTEXT
    _CONTEXT = None
