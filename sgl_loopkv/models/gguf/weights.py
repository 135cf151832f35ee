"""A loaded SGLang Llama served from its GGUF file's blocks (``--loopkv-weights gguf``, issue 53).

SGLang loads the converted folder (:mod:`sgl_loopkv.models.default_model`) as usual; then
:func:`attach` gives every linear layer and the embedding the GGUF tensors they were converted from
(:class:`BlockLinear`) and empties their float weights, so the server keeps no float copy of those
matrices. The decode-linear hooks (:mod:`sgl_loopkv.models.decode_linear`) then compute such layers
with :func:`~sgl_loopkv.models.gguf.linear.linear`, and look embeddings up by decoding only the rows read.

Which GGUF tensors make which SGLang layer (tensor parallelism 1, SGLang's merged order)::

    qkv_proj      blk.N.attn_q (rows un-permuted) | blk.N.attn_k (rows un-permuted) | blk.N.attn_v
    o_proj        blk.N.attn_output
    gate_up_proj  blk.N.ffn_gate | blk.N.ffn_up
    down_proj     blk.N.ffn_down
    embed_tokens  token_embd  (also the LM head: SmolLM2 ties them)

llama.cpp stores q/k rows interleaved per head for its rotary layout; the converter un-permutes the
float rows (transformers' ``_reverse_permute_weights``), this does the same to whole block rows.
Before a float weight is dropped its blocks are decoded and compared with it bitwise: a wrong mapping
stops the start (:class:`~sgl_loopkv.models.gguf.reader.GGUFError`), it never serves wrong numbers.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_loopkv.models.gguf.linear import linear
from sgl_loopkv.models.gguf.reader import BlockWeight, GGUFError, GGUFFile

ATTR = "_loopkv_gguf"  # the BlockLinear a layer carries

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockLinear:
    """A layer's weight as GGUF blocks: ``parts`` stacked by rows (one part per run of one block type;
    a merged layer of mixed types, e.g. Q4_K q with Q6_K v, keeps several and concatenates outputs)."""

    parts: tuple[BlockWeight, ...]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)``, in x's dtype."""
        if len(self.parts) == 1:
            return linear(x, self.parts[0], None if bias is None else bias.float())
        y = torch.cat([linear(x, p) for p in self.parts], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The decoded rows ``ids`` (an embedding lookup): ``[*ids.shape, in_features]`` in ``dtype``."""
        if len(self.parts) != 1:
            raise NotImplementedError("an embedding of several block parts")
        return self.parts[0].dequantize(ids).to(dtype)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize().view(p.out_features, -1) for p in self.parts])


def of(layer) -> BlockLinear | None:
    """The blocks :func:`attach` gave ``layer``, or None (a float layer)."""
    return getattr(layer, ATTR, None)


def _unpermute(w: BlockWeight, n_head: int) -> BlockWeight:
    """llama.cpp's q/k row order back to Hugging Face's: the rows of each head, ``[2, dim]`` -> ``[dim, 2]``."""
    dim = w.out_features // n_head // 2
    order = torch.arange(w.out_features).view(n_head, dim, 2).transpose(1, 2).reshape(-1)
    return BlockWeight(w.name, w.qtype, w.shape, w.blocks.index_select(0, order))


def _stack(parts: list[BlockWeight]) -> BlockLinear:
    """Adjacent parts of one block type as one contiguous block matrix (one kernel call per type run)."""
    runs: list[list[BlockWeight]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = []
    for run in runs:
        if len(run) == 1:
            merged.append(run[0])
            continue
        blocks = torch.cat([p.blocks for p in run])
        name = "+".join(p.name for p in run)
        merged.append(BlockWeight(name, run[0].qtype, (blocks.shape[0], run[0].in_features), blocks))
    return BlockLinear(tuple(merged))


def _plan(model, gguf: GGUFFile) -> list[tuple[str, torch.nn.Module, BlockLinear]]:
    """(SGLang name, layer, its blocks) for every layer :func:`attach` serves from blocks."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    inner = model.model
    plan = [("model.embed_tokens", inner.embed_tokens, _stack([gguf["token_embd.weight"]]))]
    if not cfg.tie_word_embeddings:
        plan.append(("lm_head", model.lm_head, _stack([gguf["output.weight"]])))
    for i in range(inner.start_layer, inner.end_layer):
        layer, b = inner.layers[i], f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        q = _unpermute(gguf[b + "attn_q.weight"], heads)
        k = _unpermute(gguf[b + "attn_k.weight"], kv_heads)
        plan += [
            (f"layers.{i}.qkv_proj", attn.qkv_proj, _stack([q, k, gguf[b + "attn_v.weight"]])),
            (f"layers.{i}.o_proj", attn.o_proj, _stack([gguf[b + "attn_output.weight"]])),
            (
                f"layers.{i}.gate_up_proj",
                mlp.gate_up_proj,
                _stack([gguf[b + "ffn_gate.weight"], gguf[b + "ffn_up.weight"]]),
            ),
            (f"layers.{i}.down_proj", mlp.down_proj, _stack([gguf[b + "ffn_down.weight"]])),
        ]
    return plan


def attach(model, gguf_path: str | Path) -> int:
    """Serve ``model`` (SGLang's ``LlamaForCausalLM``, loaded from the folder converted from ``gguf_path``)
    from the file's blocks; returns the bytes of float weights freed. Raises :class:`GGUFError` for a file
    or model it cannot serve so (another architecture, tensor parallelism, AMX-packed layers, a tensor
    whose decoded blocks are not the loaded weight)."""
    gguf = GGUFFile(gguf_path)
    if gguf.architecture != "llama" or type(model).__name__ != "LlamaForCausalLM":
        raise GGUFError(f"{gguf.path}: --loopkv-weights gguf serves Llama models ({gguf.architecture!r} here)")
    plan, freed = _plan(model, gguf), 0
    for name, layer, blocks in plan:
        w = layer.weight
        if getattr(layer, "use_intel_amx_backend", False) or getattr(layer, "tp_size", 1) != 1:
            raise GGUFError(f"{name}: AMX-packed or tensor-parallel layers are not served from GGUF blocks")
        if tuple(w.shape) != (blocks.out_features, blocks.in_features) or w.device.type != "cpu":
            raise GGUFError(
                f"{name}: weight {tuple(w.shape)} on {w.device}, GGUF blocks {blocks.out_features}x{blocks.in_features}"
            )
        if not torch.equal(blocks.dequantize().to(w.dtype), w.data):
            raise GGUFError(
                f"{name}: the decoded GGUF blocks ({blocks.parts[0].name}...) differ from the loaded weight"
            )
        freed += w.numel() * w.element_size()
        setattr(layer, ATTR, blocks)
        w.data = torch.empty(0, dtype=w.dtype)  # the float copy goes; shape checks read the blocks
    gc.collect()
    logger.info("gguf weights: %d layers from %s, %.0f MB of float weights freed", len(plan), gguf.path, freed / 2**20)
    return freed
