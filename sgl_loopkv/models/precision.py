"""The arithmetic of a prefill on GGUF weights: float32, or bfloat16 matrix units with float32 sums.

A prefill or long extend is compute-bound: its linear layers are GEMMs on dequantized weights and its
attention two GEMMs per key tile. oneDNN's batch-reduce GEMM multiplies bfloat16 operands several times
faster than float32 ones with AMX-BF16, and about twice as fast with AVX512-BF16's dot products (an AMD
EPYC's). In bfloat16 mode:

- linear layers (``MIN_ROWS`` new rows or more): x and the weight are rounded to bfloat16 once each, the
  products summed in float32 and the float32 sums are the result (``gemm_bf16`` in ``kernels/gguf_linear.cpp``);
- attention (64 rows or more, over the GGUF path's bfloat16 pool): the queries are never rounded to
  bfloat16, which cost the prefill path its fidelity bar, but split in two bfloat16 parts, at close to
  float32 accuracy (:func:`sgl_loopkv.attention.executor.prefill_kernel`); the softmax weights are split
  like the queries (``--loopkv-prefill-softmax split``, the default) or rounded to bfloat16 once
  (``bfloat16``, as FlashAttention's P V on GPUs: half the P V products, below the multi-turn fidelity bar
  on the default model, docs/decisions/2026-12-08-prefill-softmax-rounded-once.md).

Decode steps and short extends never change: they stay float32, so a decode is the dequantized model's
arithmetic. ``--loopkv-prefill-dtype`` (the plugin calls :func:`use` on the GGUF path only) is ``auto`` by
default: bfloat16 where the CPU reports ``amx_bf16`` or ``avx512_bf16`` (read at run time), float32 elsewhere,
where bfloat16 is emulated and slower than float32. Against the float32 model the bfloat16
prefill path is within the fidelity bar over three contexts per length
(docs/decisions/2026-12-06-split-bf16-prefill-attention.md).
"""

from __future__ import annotations

import functools
import os

from sgl_loopkv.platform import cpu_flags, cpu_has_native_bf16

MODES = ("auto", "float32", "bfloat16")
SOFTMAX_MODES = ("bfloat16", "split")
#: Overrides the server's choice in this process (tests, A/B timings).
ENV = "LOOPKV_PREFILL_DTYPE"
SOFTMAX_ENV = "LOOPKV_PREFILL_SOFTMAX"
#: New rows from which a forward counts as a prefill here: above the GGUF gemv path's 16 rows, so a
#: decode step or short extend keeps the float32 arithmetic whatever the mode.
MIN_ROWS = 17
_chosen = "float32"  # until the plugin passes the launched config's (the float32 path never opts in)
_softmax = "split"


def use(mode: str, softmax: str = "split") -> None:
    """This process's ``--loopkv-prefill-dtype`` and ``--loopkv-prefill-softmax``."""
    global _chosen, _softmax
    if mode not in MODES:
        raise ValueError(f"prefill dtype {mode!r}: expected one of {MODES}")
    if softmax not in SOFTMAX_MODES:
        raise ValueError(f"prefill softmax {softmax!r}: expected one of {SOFTMAX_MODES}")
    _chosen, _softmax = mode, softmax
    prefill_bf16.cache_clear()
    split_softmax.cache_clear()


def _setting(env: str, chosen: str, modes: tuple[str, ...]) -> str:
    """The process override ``env`` if set, else the server's ``chosen`` value, one of ``modes``."""
    value = os.environ.get(env, "").strip().lower() or chosen
    if value not in modes:
        raise ValueError(f"{env}={value!r}: expected one of {modes}")
    return value


@functools.cache
def prefill_bf16() -> bool:
    """Whether prefills run in bfloat16 in this process (``LOOPKV_PREFILL_DTYPE`` if set, else :func:`use`'s)."""
    value = _setting(ENV, _chosen, MODES)
    return cpu_has_native_bf16(cpu_flags()) if value == "auto" else value == "bfloat16"


@functools.cache
def split_softmax() -> bool:
    """Whether a bfloat16 prefill's attention splits its softmax weights in two bfloat16 parts
    (``LOOPKV_PREFILL_SOFTMAX`` if set, else :func:`use`'s) rather than rounding them once."""
    return _setting(SOFTMAX_ENV, _softmax, SOFTMAX_MODES) == "split"


def bf16_rows(rows: int) -> bool:
    """Whether a forward of ``rows`` new rows runs in bfloat16."""
    return rows >= MIN_ROWS and prefill_bf16()
