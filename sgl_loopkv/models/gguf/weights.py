"""A loaded SGLang Llama served from its GGUF file's blocks (issue 53).

Two starts end here, once SGLang has loaded the model (:func:`attach`):

- ``--model-path x.gguf`` on the CPU: SGLang's own GGUF path loads the file (``--load-format gguf``,
  ``GGUFConfig``; its layers hold the raw blocks as ``qweight``, the tokenizer and chat template come
  from the file's metadata), but its GGUF kernels are CUDA-only. Each layer's loaded blocks are checked
  byte for byte against the mapped file and dropped: the layer computes from the file's blocks;
- ``--loopkv-weights gguf`` with the embedded default model: SGLang loads the converted float folder
  (:mod:`sgl_loopkv.models.default_model`); each float weight is checked bitwise against its decoded
  blocks and dropped.

Either way every linear layer and the embedding carries a :class:`BlockLinear` and keeps no copy of its
weight matrix; the decode-linear hooks (:mod:`sgl_loopkv.models.decode_linear`) then compute such
layers with :func:`~sgl_loopkv.models.gguf.linear.linear`, and look embeddings up by decoding only the
rows read.

Which GGUF tensors make which SGLang layer (tensor parallelism 1, SGLang's merged order)::

    qkv_proj      blk.N.attn_q (rows un-permuted) | blk.N.attn_k (rows un-permuted) | blk.N.attn_v
    o_proj        blk.N.attn_output
    gate_up_proj  blk.N.ffn_gate | blk.N.ffn_up
    down_proj     blk.N.ffn_down
    embed_tokens  token_embd  (also the LM head when the file has no ``output``: tied)
    lm_head       output

llama.cpp's converter stores a Llama's q/k rows interleaved per head for its rotary layout; Hugging
Face's (and SGLang's Llama, which rotates in neox style) are not. This un-permutes whole block rows, as
transformers' ``_reverse_permute_weights`` does float rows. A wrong mapping stops the start
(:class:`~sgl_loopkv.models.gguf.reader.GGUFError`); it never serves wrong numbers.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_loopkv.models.gguf.linear import linear
from sgl_loopkv.models.gguf.reader import BlockWeight, GGUFError, GGUFFile
from sgl_loopkv.models.metrics import set_gauge

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


#: ``general.architecture`` values served, each with the SGLang model class its GGUF loader builds for it
#: (Mistral and SmolLM files say ``llama``; Qwen2's q/k/v carry biases, which stay float32 parameters).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Architectures whose q and k rows llama.cpp's converter permuted (Hugging Face's order is restored here).
PERMUTED_QK = ("llama",)
#: The tensors of each block ``blk.N.`` that :func:`_plan` maps (the launcher checks a file has them all).
LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True, slots=True)
class _Planned:
    name: str  # SGLang's
    layer: torch.nn.Module
    blocks: BlockLinear  # what the layer computes from
    raw: tuple[BlockWeight, ...]  # the file's tensors in SGLang's shard order, as stored (for the byte check)


def _plan(model, gguf: GGUFFile) -> list[_Planned]:
    """Every layer :func:`attach` serves from blocks, with its blocks."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    qk = (heads, kv_heads) if gguf.architecture in PERMUTED_QK else ()
    inner = model.model

    def planned(name, layer, tensors, unpermute=()):
        raw = [gguf[t] for t in tensors]
        served = [_unpermute(w, unpermute[j]) if j < len(unpermute) else w for j, w in enumerate(raw)]
        return _Planned(name, layer, _stack(served), tuple(raw))

    plan = [planned("model.embed_tokens", inner.embed_tokens, ["token_embd.weight"])]
    if not cfg.tie_word_embeddings:
        plan.append(planned("lm_head", model.lm_head, ["output.weight"]))
    for i in range(inner.start_layer, inner.end_layer):
        layer, b = inner.layers[i], f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        plan += [
            planned(f"layers.{i}.qkv_proj", attn.qkv_proj, [b + f"attn_{n}.weight" for n in "qkv"], qk),
            planned(f"layers.{i}.o_proj", attn.o_proj, [b + "attn_output.weight"]),
            planned(f"layers.{i}.gate_up_proj", mlp.gate_up_proj, [b + "ffn_gate.weight", b + "ffn_up.weight"]),
            planned(f"layers.{i}.down_proj", mlp.down_proj, [b + "ffn_down.weight"]),
        ]
    return plan


def _loaded_blocks(layer) -> list[tuple[int, torch.Tensor]] | None:
    """(GGUF type, bytes ``[rows, row_bytes]``) per shard of a layer SGLang's GGUF path loaded, in shard
    order; None for a float layer. A merged layer's shards sit in one padded ``qweight``
    (``shard_offset_map``: rows and byte width of each)."""
    qweight = getattr(layer, "qweight", None)
    if qweight is None:
        return None
    kinds = layer.qweight_type
    as_bytes = lambda t: t.contiguous().view(torch.uint8).view(t.shape[0], -1)  # noqa: E731  (F16/F32 rows too)
    offsets = getattr(qweight, "shard_offset_map", None)
    if not offsets:
        return [(int(kinds.weight_type), as_bytes(qweight.data))]
    return [(int(kinds.shard_weight_type[i]), as_bytes(qweight.data[a:b, :w])) for i, (a, b, w) in offsets.items()]


def _check(p: _Planned) -> int:
    """Check that ``p.layer`` as SGLang loaded it is what the file's blocks decode to; returns its bytes."""
    loaded = _loaded_blocks(p.layer)
    if loaded is not None:  # SGLang's GGUF path: the same bytes, shard by shard
        if len(loaded) != len(p.raw) or any(
            int(w.qtype) != kind or not torch.equal(w.blocks, got) for w, (kind, got) in zip(p.raw, loaded)
        ):
            raise GGUFError(f"{p.name}: the blocks SGLang loaded differ from the file's {[w.name for w in p.raw]}")
        return sum(got.numel() for _, got in loaded)
    w = p.layer.weight
    if tuple(w.shape) != (p.blocks.out_features, p.blocks.in_features) or w.device.type != "cpu":
        raise GGUFError(
            f"{p.name}: weight {tuple(w.shape)} on {w.device}, GGUF blocks {p.blocks.out_features}x{p.blocks.in_features}"
        )
    if not torch.equal(p.blocks.dequantize().to(w.dtype), w.data):
        raise GGUFError(
            f"{p.name}: the decoded GGUF blocks ({p.blocks.parts[0].name}...) differ from the loaded weight"
        )
    return w.numel() * w.element_size()


def _drop_loaded(layer) -> None:
    """The layer's own copy of its weight goes (the blocks are served from the mapped file)."""
    param = layer.qweight if hasattr(layer, "qweight") else layer.weight
    param.data = torch.empty(0, dtype=param.dtype)


def attach(model, gguf_path: str | Path) -> int:
    """Serve ``model`` (SGLang's ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``, loaded from ``gguf_path`` by
    SGLang's GGUF path or from the folder converted from it) from the file's blocks; returns the bytes of
    loaded weights freed.
    Raises :class:`GGUFError` for a file or model it cannot serve so (another architecture, tensor
    parallelism, AMX-packed layers, a layer whose loaded weight is not what the file's blocks hold)."""
    gguf = GGUFFile(gguf_path)
    if type(model).__name__ != ARCHITECTURES.get(gguf.architecture):
        raise GGUFError(
            f"{gguf.path}: GGUF blocks are served for {', '.join(ARCHITECTURES.values())} "
            f"({gguf.architecture!r} file, {type(model).__name__} model here)"
        )
    plan, freed = _plan(model, gguf), 0
    for p in plan:
        if getattr(p.layer, "use_intel_amx_backend", False) or getattr(p.layer, "tp_size", 1) != 1:
            raise GGUFError(f"{p.name}: AMX-packed or tensor-parallel layers are not served from GGUF blocks")
        freed += _check(p)
        setattr(p.layer, ATTR, p.blocks)
        _drop_loaded(p.layer)  # shape checks read the blocks
    gc.collect()
    logger.info("gguf weights: %d layers from %s, %.0f MB of loaded weights freed", len(plan), gguf.path, freed / 2**20)
    set_gauge("loopkv_gguf_layers", "Linear layers and embeddings served from the GGUF file's blocks", len(plan))
    return freed


def decode_step_linears(gguf: GGUFFile) -> list[BlockLinear]:
    """The block matrices one decode step of a llama-family file multiplies, in order (per block qkv,
    output, gate+up, down; then the LM head, ``output`` or the tied ``token_embd``), stacked as
    :func:`attach` serves them; q/k rows as stored (for timing and byte counts, not for serving)."""
    n_blocks = int(gguf.metadata(f"{gguf.architecture}.block_count", 0))
    out = []
    for i in range(n_blocks):
        b = f"blk.{i}."
        out += [
            _stack([gguf[b + f"attn_{n}.weight"] for n in "qkv"]),
            _stack([gguf[b + "attn_output.weight"]]),
            _stack([gguf[b + "ffn_gate.weight"], gguf[b + "ffn_up.weight"]]),
            _stack([gguf[b + "ffn_down.weight"]]),
        ]
    head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    return [*out, _stack([gguf[head]])]
