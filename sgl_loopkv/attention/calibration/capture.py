"""Run a Hugging Face model once and keep every layer's post-RoPE q, k, v (the tensors an
attention backend receives), for calibration and for the attention-only benchmark."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NAME = "loopkv_capture"
_store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True, slots=True)
class LayerQKV:
    """One layer of one sequence: q [n, Hq, D], k and v [n, Hkv, D] (position order), scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


def _capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # [1, heads, tokens, D] -> [tokens, heads, D]; key/value still have num_kv_heads heads here
    _store[module.layer_idx] = (
        query[0].transpose(0, 1).clone(),
        key[0].transpose(0, 1).clone(),
        value[0].transpose(0, 1).clone(),
        scaling,
    )
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def load_capturing_model(model_dir):
    """The model in fp32 with an attention function that records q/k/v of every layer."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(_NAME, _capture)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=_NAME).eval()


@torch.no_grad()
def capture_qkv(model, input_ids: list[int]) -> tuple[list[LayerQKV], torch.Tensor]:
    """Prefill ``input_ids`` (one sequence) -> (per-layer q/k/v, last-position logits [vocab])."""
    _store.clear()
    logits = model(torch.tensor([input_ids]), use_cache=False, logits_to_keep=1).logits[0, -1]
    layers = [LayerQKV(*_store[i]) for i in sorted(_store)]
    _store.clear()
    return layers, logits
