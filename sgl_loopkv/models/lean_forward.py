"""Llama forwards on the CPU without SGLang's per-layer machinery, bitwise the same numbers.

Why: a decode step of the default model is 30 layers x ~10 modules of one token each. On two cores
its linear layers take ~27 ms (weights streamed from memory) and SGLang's Python around them took
another ~15 ms: module calls, the layer-boundary stages that carry the residual between the attention
and the MLP (built for tensor/pipeline-parallel layouts and fused quantized reads), the CustomOp
dispatch of every norm, rotary embedding and activation. A short prefill (a chat turn) pays the same
per forward. A plain loop over the same layers costs a fraction of that.

:func:`lean_model_forward` is an AROUND hook on ``LlamaModel.forward``. For a decode or extend batch of
a model it can run (:func:`runnable`: one pipeline and tensor-parallel rank, no AMX, SGLang's own Llama
layers with plain weights and a neox rotary embedding over whole heads) it runs every layer in a plain
loop, calling what the layers' modules would: each norm's and activation's own module (SGLang's
CustomOp dispatch), :func:`~sgl_loopkv.models.decode_linear.project` for the projections (what
SGLang's linear layers call through the decode-linear hook: float weights or GGUF blocks), the rotary embedding's element operations in SGLang's order, and the layer's own
``RadixAttention.forward``, so the attention backend (KV writes, tiers, sparse and pruned plans,
metrics) sees exactly the calls it sees otherwise. The residual stream is the plain one
(``h = norm(x + residual)``) that the stages compute for such a model. ``tests/e2e/test_lean_forward.py``
holds greedy tokens and every logprob of both paths bitwise equal (tiny model in float32 and bfloat16,
SmolLM2), and the SGLang sources this mirrors are pinned in :mod:`sgl_loopkv.sglang_privates`. Every
other batch and model goes to SGLang's forward. ``LOOPKV_LEAN_FORWARD=0`` turns it off.

On the GGUF path (:func:`layer_ops`) the norms, the rotary embedding and the activation are one compiled
call each (``kernels/layer_ops.cpp``) instead of SGLang's torch composition, which cost about as much per
decode step as the block matrices: within float32 rounding of SGLang's (the rotary embedding bitwise),
so the float32 path keeps the torch ops and its bitwise contract.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from sgl_loopkv.models import step_timing
from sgl_loopkv.models.decode_linear import project
from sgl_loopkv.models.gguf import weights as gguf_weights
from sgl_loopkv.models.metrics import set_gauge

TARGET = "sglang.srt.models.llama.LlamaModel.forward"
ENV = "LOOPKV_LEAN_FORWARD"

_RUNNABLE = "_loopkv_lean_forward"  # attribute caching runnable(model) on the model
_LAYER_OPS = "_loopkv_layer_ops"  # attribute caching layer_ops(model)

logger = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _plain_linear(layer) -> bool:
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    common = not getattr(layer, "skip_bias_add", False) and getattr(layer, "tp_size", 1) == 1
    if gguf_weights.of(layer) is not None:  # GGUF blocks (any quant method SGLang loaded them with)
        return common and not getattr(layer, "use_intel_amx_backend", False)
    w = getattr(layer, "weight", None)
    plain_weight = isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
    return (
        common
        and type(getattr(layer, "quant_method", None)) is UnquantizedLinearMethod
        and not getattr(layer, "use_intel_amx_backend", False)
        and plain_weight
        and (layer.bias is None or layer.bias.dtype == w.dtype)
    )


def runnable(model) -> bool:
    """Whether :func:`lean_forward` computes what ``model.forward`` does for a decode or extend batch
    (decided once per model, from its modules; logged, and ``loopkv_lean_forward`` on ``/metrics``)."""
    ok = getattr(model, _RUNNABLE, None)
    if ok is None:
        why_not = _why_not(model)
        ok = why_not is None
        setattr(model, _RUNNABLE, ok)
        logger.info("lean forward: %s", "on" if ok else f"off ({why_not})")
        set_gauge("loopkv_lean_forward", "1: the lean forward runs the model's decode and extend batches", int(ok))
    return ok


def _why_not(model) -> str | None:
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb
    from sglang.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from sglang.srt.utils import cpu_has_amx_support

    if cpu_has_amx_support():
        return "AMX: SGLang's CPU norms, rotary embedding and activation are sgl_kernel ops"
    pp = getattr(model, "pp_group", None)
    if pp is None or pp.world_size != 1:
        return "pipeline parallel"
    emb = getattr(model.embed_tokens, "weight", getattr(model.embed_tokens, "qweight", None))
    if type(model.norm) is not RMSNorm or emb is None or emb.device.type != "cpu":
        return "not a CPU model with an RMSNorm head"
    for i in range(model.start_layer, model.end_layer):
        layer = model.layers[i]
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (
            type(layer) is LlamaDecoderLayer
            and type(attn) is LlamaAttention
            and type(mlp) is LlamaMLP
            and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and type(mlp.act_fn) is SiluAndMul
        ):
            return f"layer {i} is not SGLang's Llama layer"
        rope = attn.rotary_emb
        if not (
            type(rope) is RotaryEmbedding
            and rope.is_neox_style
            and rope.rotary_dim == rope.head_size == attn.head_dim
            and rope._apply_rotary_emb_wrapped is apply_rotary_emb  # not a compiled copy
        ):
            return f"layer {i}: not a plain neox rotary embedding over whole heads"
        if mlp.dual_gemm.mode is not None or mlp.activation_quant.enabled:
            return f"layer {i}: fused MLP kernels"
        if not all(_plain_linear(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return f"layer {i}: quantized, AMX-packed, LoRA or tensor-parallel linear layers"
    return None


def _cos_sin(rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary factors of ``positions``, [n, 1, D / 2] each, as ``RotaryEmbedding.forward_native``
    takes them from its cache."""
    cos, sin = rope.cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of the query and key heads together, [n, Hq + Hkv, D]: the element
    operations of SGLang's ``apply_rotary_emb`` in its order (each output element is computed alone, so
    rotating the query and key heads in one call gives each the same bits)."""
    x1, x2 = torch.chunk(qk, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def layer_ops(model):
    """The compiled element-wise layer ops (:mod:`sgl_loopkv.kernels.layer_ops`) where they replace SGLang's
    torch composition for ``model``, else None (decided once per model; ``loopkv_layer_ops`` on ``/metrics``).
    Only a GGUF-weight model in float32 takes them: their norm and activation are within float32 rounding
    of SGLang's, not bitwise, and the float32 path's contract is SGLang's forward bit for bit."""
    ops = getattr(model, _LAYER_OPS, False)
    if ops is False:
        ops = _layer_ops_for(model)
        setattr(model, _LAYER_OPS, ops)
        logger.info("layer ops: %s", "compiled" if ops is not None else "SGLang's torch ops")
        set_gauge(
            "loopkv_layer_ops", "1: the compiled norm, rotary and activation ops run the GGUF model", int(bool(ops))
        )
    return ops


def _layer_ops_for(model):
    layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    norms = [model.norm] + [n for la in layers for n in (la.input_layernorm, la.post_attention_layernorm)]
    if not layers or gguf_weights.of(layers[0].self_attn.qkv_proj) is None:
        return None
    plain_norms = all(
        n.weight.dtype == torch.float32 and n.variance_size_override is None and n.override_orig_dtype is None
        for n in norms
    )
    caches = all(
        (c := la.self_attn.rotary_emb.cos_sin_cache).dtype == torch.float32
        and c.is_contiguous()
        and c.shape[-1] == la.self_attn.head_dim
        for la in layers
    )
    if not (plain_norms and caches):
        return None
    from sgl_loopkv.kernels import layer_ops as compiled

    return compiled.load()


def _norm(ops, norm, x: torch.Tensor, residual: torch.Tensor | None):
    """``norm(x)`` / ``norm(x, residual)`` as SGLang's RMSNorm returns them."""
    if ops is None:
        return norm(x) if residual is None else norm(x, residual)
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    return ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)


def _attend(layer, plain, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch) -> torch.Tensor:
    """The layer's attention: the backend's two-call plain decode where it takes the layer, else
    ``RadixAttention.forward``."""
    if plain is None or (o := plain(layer, q, k, v)) is None:
        o = layer.forward(q, k, v, forward_batch)
    return o


@torch.no_grad()
def lean_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, timing=None) -> torch.Tensor:
    """``model.forward`` for a decode or extend batch of a :func:`runnable` model: the final-normed hidden
    states. ``timing`` (:class:`~sgl_loopkv.models.step_timing.StepTiming`): its projections and attention
    calls are timed."""
    x = model.embed_tokens(input_ids)
    n = x.shape[0]
    residual = None
    ops = layer_ops(model)
    flat_positions = positions.flatten()
    if ops is not None and (flat_positions.dtype != torch.int64 or x.dtype != torch.float32):
        ops = None
    rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per rotary module (SGLang shares one)
    plain = _plain_decode(forward_batch)
    proj, attend = (
        (project, _attend) if timing is None else (timing.timed(project, "weights"), timing.timed(_attend, "attention"))
    )
    for i in range(model.start_layer, model.end_layer):
        layer = model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        if residual is None:
            residual, h = x, _norm(ops, layer.input_layernorm, x, None)
        else:
            h, residual = _norm(ops, layer.input_layernorm, x, residual)
        qkv = proj(attn.qkv_proj, h, attn.qkv_proj.bias)
        rope = attn.rotary_emb
        if ops is not None:
            q, k = ops.rope_neox(
                qkv, flat_positions, rope.cos_sin_cache, attn.num_heads, attn.num_kv_heads, attn.head_dim
            )
        else:
            if (cs := rotary.get(id(rope))) is None:
                cs = rotary[id(rope)] = _cos_sin(rope, positions, qkv.dtype)
            qk = _rotate(qkv[:, : attn.q_size + attn.kv_size].view(n, -1, attn.head_dim), *cs)
            # [n, q_size] and [n, kv_size] as SGLang's rotary embedding returns them (a backend may shape its
            # output like q: torch_native does)
            q, k = qk[:, : attn.num_heads].reshape(n, -1), qk[:, attn.num_heads :].reshape(n, -1)
        v = qkv[:, attn.q_size + attn.kv_size :]
        o = attend(attn.attn, plain, q, k, v, forward_batch)
        x = proj(attn.o_proj, o, attn.o_proj.bias)
        h, residual = _norm(ops, layer.post_attention_layernorm, x, residual)
        gate_up = proj(mlp.gate_up_proj, h, mlp.gate_up_proj.bias)
        x = proj(mlp.down_proj, mlp.act_fn(gate_up) if ops is None else ops.silu_mul(gate_up), mlp.down_proj.bias)
    return _norm(ops, model.norm, x, residual)[0]


def _plain_decode(forward_batch):
    """The attention backend's two-call decode layer for this batch (the loopkv backend sets one when no
    mechanism watches a plain CPU decode: :mod:`sgl_loopkv.attention.plain_decode`), else None."""
    if not forward_batch.forward_mode.is_decode():
        return None
    from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

    return getattr(get_attn_backend(), "plain_decode", None) if has_forward_context() else None


def _lean_modes() -> tuple:
    """Plain decode and prefill batches (not mixed chunked prefill, speculative or split modes)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return (ForwardMode.DECODE, ForwardMode.EXTEND)


def lean_model_forward(
    original, self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **kw
):
    """AROUND hook on ``LlamaModel.forward``."""
    if (
        not kw
        and input_embeds is None
        and not self.layers_to_capture
        and pp_proxy_tensors is None
        and forward_batch.forward_mode in _lean_modes()
        and input_ids.numel() > 0
        and enabled()
        and not torch.compiler.is_compiling()
        and runnable(self)
    ):
        if (timing := step_timing.active()) is None:
            return lean_forward(self, input_ids, positions, forward_batch)
        decode = forward_batch.forward_mode.is_decode()
        timing.begin(decode)
        t0 = time.perf_counter()
        out = lean_forward(self, input_ids, positions, forward_batch, timing if decode else None)
        if decode:
            timing.publish(time.perf_counter() - t0)
        return out
    if (timing := step_timing.active()) is not None:
        timing.begin(False)
    return original(self, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, **kw)
