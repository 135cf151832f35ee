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

The plugin registers them only in servers started by sgl-loopkv's launcher, never with
``--loopkv-stock`` (the baseline is SGLang as shipped).
"""

from __future__ import annotations

from sgl_loopkv.kernels.decode_linear import applies, linear

LINEAR_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"


def linear_apply(original, self, layer, x, bias=None, *args, **kwargs):
    """AROUND hook on ``UnquantizedLinearMethod.apply``."""
    if not args and not kwargs and not getattr(layer, "use_intel_amx_backend", False) and applies(x, layer.weight):
        if bias is None or bias.dtype == x.dtype:
            return linear(x, layer.weight, bias)
    return original(self, layer, x, bias, *args, **kwargs)


def compute_lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    """AROUND hook on ``LogitsProcessor._compute_lm_head``."""
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
