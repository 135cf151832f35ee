"""SGLang's CPU linear layers and LM head through :func:`sgl_loopkv.kernels.decode_linear.linear`.

A decode step on the CPU is mostly the model's linear layers, each a few rows against a weight
matrix streamed from memory; ATen runs those on one thread (MKL's gemv), so stock SGLang reads its
weights at one core's memory rate. Two AROUND hooks (SGLang's ``HookRegistry``) send the few-row
calls to :func:`~sgl_loopkv.kernels.decode_linear.linear`: float32 and bfloat16 calls of up to
32 / 24 rows (``GEMV_MAX_ROWS``) to our AVX-512 kernels (fixed-order sums, at least as close to the
exact sum as torch's, not ``F.linear``'s bits; ``LOOPKV_EXACT_LINEAR=1`` keeps those), the others to the split kernel, which
returns bitwise what ``F.linear`` returns. Every other call, and every other device, goes to SGLang's own code:

- ``UnquantizedLinearMethod.apply`` (q/k/v/o, gate/up/down): SGLang's CPU path is ``F.linear``
  unless the layer runs on Intel AMX (``sgl_kernel``'s packed weights, left alone).
- ``LogitsProcessor._compute_lm_head`` (an SGLang private; pinned in :mod:`sgl_loopkv.sglang_privates`):
  its plain-weight branch is ``hidden @ lm_head.weight.T``; LoRA, quantized and AMX heads, an fp32
  head and the RL on-policy path keep SGLang's code.

A layer that carries GGUF blocks (a ``.gguf`` model path or ``--loopkv-weights gguf``:
:mod:`sgl_loopkv.models.gguf.weights`, attached by :func:`attach_gguf_after_load` once SGLang has loaded
the model) keeps no copy of its weight: both hooks compute it from its blocks at any row count, and so
do AROUND hooks on the embedding methods (only the rows a batch looks up are decoded) and on SGLang's
``GGUFLinearMethod.apply`` (whose kernels are CUDA-only; this is their CPU implementation).

The plugin registers them only in servers started by sgl-loopkv's launcher, never with
``--loopkv-stock`` (the baseline is SGLang as shipped); the GGUF ones only for GGUF weights.
"""

from __future__ import annotations

import time

from sgl_loopkv.kernels.decode_linear import applies, linear
from sgl_loopkv.models import step_timing
from sgl_loopkv.models.gguf import weights as gguf_weights
from sgl_loopkv.models.gguf.reader import GGUFError

LINEAR_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
EMBEDDING_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedEmbeddingMethod.embedding"
GGUF_LINEAR_TARGET = "sglang.srt.layers.quantization.gguf.GGUFLinearMethod.apply"
GGUF_EMBEDDING_TARGET = "sglang.srt.layers.quantization.gguf.GGUFEmbeddingMethod.embedding"
LOAD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"


def project(layer, x, bias=None):
    """``layer``'s linear map of x, from its GGUF blocks or its float weight (what :func:`linear_apply`
    computes; the lean forward calls it directly)."""
    blocks = gguf_weights.of(layer)
    return blocks(x, bias) if blocks is not None else linear(x, layer.weight, bias)


def linear_apply(original, self, layer, x, bias=None, *args, **kwargs):
    """AROUND hook on ``UnquantizedLinearMethod.apply``."""
    if (blocks := gguf_weights.of(layer)) is not None:
        return blocks(x, bias)
    if not args and not kwargs and not getattr(layer, "use_intel_amx_backend", False) and applies(x, layer.weight):
        if bias is None or bias.dtype == x.dtype:
            return linear(x, layer.weight, bias)
    return original(self, layer, x, bias, *args, **kwargs)


def compute_lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    """AROUND hook on ``LogitsProcessor._compute_lm_head`` (timed as a decode step's part where
    :mod:`~sgl_loopkv.models.step_timing` is on)."""
    if (timing := step_timing.active()) is None:
        return _lm_head(original, self, hidden_states, lm_head, embedding_bias, **kwargs)
    t0 = time.perf_counter()
    try:
        return _lm_head(original, self, hidden_states, lm_head, embedding_bias, **kwargs)
    finally:
        timing.add_lm_head(time.perf_counter() - t0)


def _lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    if (blocks := gguf_weights.of(lm_head)) is not None:  # SGLang's CPU head ignores ``out`` and the bias too
        return blocks(hidden_states)
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    w = getattr(lm_head, "weight", None)
    if (
        w is not None
        and not hasattr(lm_head, "set_lora")
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not self.use_fp32_lm_head
        and not getattr(lm_head, "use_intel_amx_backend", False)
        and getattr(self, "rl_on_policy_target", None) is None
        and applies(hidden_states, w)
    ):
        return linear(hidden_states, w)
    return original(self, hidden_states, lm_head, embedding_bias, **kwargs)


def embedding(original, self, layer, input_):
    """AROUND hook on ``UnquantizedEmbeddingMethod.embedding`` and ``GGUFEmbeddingMethod.embedding``:
    the looked-up rows decoded from blocks."""
    if (blocks := gguf_weights.of(layer)) is not None:
        dtype = layer.weight.dtype if hasattr(layer, "weight") else self.params_dtype
        return blocks.rows(input_, dtype)
    return original(self, layer, input_)


def gguf_linear_apply(original, self, layer, x, bias=None):
    """AROUND hook on SGLang's ``GGUFLinearMethod.apply`` (also the LM head of a GGUF model)."""
    if (blocks := gguf_weights.of(layer)) is not None:
        return blocks(x, bias)
    return original(self, layer, x, bias)


def attach_gguf_after_load(result, runner, *args, **kwargs):
    """AFTER hook on ``ModelRunner.load_model``: the loaded model served from its GGUF file: the model
    path itself (SGLang's GGUF path loaded it) or the file the folder was converted from (the launcher
    has checked that there is one)."""
    from sgl_loopkv.models.default_model import converted_from
    from sgl_loopkv.models.gguf.serving import gguf_file_of

    path = runner.model_config.model_path
    source = gguf_file_of(path) or converted_from(path)
    if source is None:
        raise GGUFError(f"{path}: neither a GGUF file nor a folder converted from one")
    gguf_weights.attach(runner.model, source)
    return result
