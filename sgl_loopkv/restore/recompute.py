"""Recompute the front tokens of a returning history, layer by layer, with fewer tokens per layer.

A decoder is seen as per-layer steps (:class:`LayerStack`) so the restorer can cut the hidden
states between layers to the plan's count; SGLang's model forward runs one token count through
every layer and cannot. Attention here is dense over (tokens already on the device) + (the rows
recomputed so far): the front needs nothing that is being loaded. The attention function is the
stack's (the server's dense attention, handed in by whoever builds the stack: this package imports
no attention code).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from sgl_loopkv.restore.plan import RestorePlan


class LayerStack(ABC):
    """A Llama/Qwen2-style decoder as steps. Shapes: x [n, hidden]; q [n, Hq, D]; k, v [n, Hkv, D]."""

    num_layers: int
    scale: float

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Input norm, projections and rotary embedding of layer ``layer``."""

    @abstractmethod
    def finish(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, post-attention norm, MLP, residual -> next layer's x.
        ``attn`` is [n, Hq, D]."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the ``n`` rows q [n, Hq, D] over keys k, v [L >= n, Hkv, D] whose last
        ``n`` are the rows' own -> [n, Hq, D]."""


#: (layer, k [s, Hkv, D], v) -> the K/V as stored (the pool's dtype: what the server's forward attends
#: to), or None where they are kept as given
KVSink = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]
PrefixKV = Callable[[int], tuple[torch.Tensor, torch.Tensor] | None]  # layer -> K, V of the device prefix


@torch.inference_mode()
def recompute_front(
    stack: LayerStack,
    plan: RestorePlan,
    token_ids: torch.Tensor,
    start: int,
    write: KVSink,
    prefix_kv: PrefixKV = lambda layer: None,
) -> None:
    """Recompute K/V of tokens ``token_ids[:plan.recompute[l]]`` (absolute positions ``start + i``)
    for every layer ``l`` and hand them to ``write``. ``prefix_kv(l)`` gives the K/V of the
    ``start`` positions before them (None when ``start == 0``)."""
    s0 = plan.recompute_tokens
    if s0 == 0:
        return
    x = stack.embed(token_ids[:s0])
    positions = torch.arange(start, start + s0, device=x.device)
    for layer in range(plan.num_layers):
        s = plan.recompute[layer]
        if s == 0:
            break
        x, pos = x[:s], positions[:s]
        q, k, v = stack.qkv(layer, x, pos)
        k, v = write(layer, k, v) or (k, v)  # a bf16 pool under a float32 model: attend to the rounded K/V
        prefix = prefix_kv(layer) if start else None
        keys, values = (k, v) if prefix is None else (torch.cat([prefix[0], k]), torch.cat([prefix[1], v]))
        attn = stack.attention(q, keys, values)
        if layer + 1 < plan.num_layers and plan.recompute[layer + 1] > 0:
            x = stack.finish(layer, x, attn)


class SGLangLayerStack(LayerStack):
    """SGLang's own modules of a loaded Llama/Qwen2 model (``model_runner.model``): the same weights
    and kernels as the server's forward, called step by step. ``attend(q, k, v, scale)``: the
    attention function (the loopkv backend's dense attention)."""

    def __init__(self, model: torch.nn.Module, attend: Callable[..., torch.Tensor]):
        self._attend = attend
        inner = model.model
        self.embed_tokens, self.layers = inner.embed_tokens, inner.layers
        attn = self.layers[0].self_attn
        for need in ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size"):
            if not hasattr(attn, need):
                raise NotImplementedError(f"partial recompute supports Llama/Qwen2-style layers (no {need})")
        self.num_layers = len(self.layers)
        self.scale = attn.attn.scaling
        self.hq, self.hkv, self.d = attn.attn.tp_q_head_num, attn.attn.tp_k_head_num, attn.attn.qk_head_dim

    def embed(self, token_ids):
        device = next(self.embed_tokens.parameters()).device  # ``weight`` or a GGUF model's ``qweight``
        return self.embed_tokens(token_ids.to(device))

    def qkv(self, layer, x, positions):
        blk = self.layers[layer]
        a = blk.self_attn
        h = blk.input_layernorm.forward_native(x)
        qkv, _ = a.qkv_proj(h)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q, k = a.rotary_emb(positions, q, k)
        n = x.shape[0]
        return q.reshape(n, self.hq, self.d), k.reshape(n, self.hkv, self.d), v.reshape(n, self.hkv, self.d)

    def attention(self, q, k, v):
        return self._attend(q, k, v, self.scale)

    def finish(self, layer, x, attn):
        blk = self.layers[layer]
        o, _ = blk.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        h, residual = blk.post_attention_layernorm.forward_native(o, x)
        return residual + blk.mlp(h)
