"""GGUF blocks served (``sgl_loopkv/models/gguf/weights.py``): the default model's layers served from its
GGUF blocks compute what the converted float weights compute, through the decode-linear hooks, whether
SGLang loaded the converted folder (``--loopkv-weights gguf``) or the file itself (``--model-path x.gguf``:
its GGUF layers, laid out by SGLang's own ``GGUFLinearMethod``).

The model here is a stand-in with SGLang's Llama module names and the first two layers of the converted
default model (the mapping, the q/k row un-permutation and the hooks are what is tested, not SGLang's
loader: ``tests/e2e/test_gguf_weights.py`` serves the real one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import decode_linear
from sgl_loopkv.models.default_model import converted_from, default_model_gguf, ensure_default_model
from sgl_loopkv.models.gguf import GGUFError, weights
from sgl_loopkv.server.launch import refuse_gguf_weights_without_a_source

LAYERS = 2


def _linear(w: torch.Tensor) -> nn.Module:
    m = nn.Module()
    m.weight, m.bias = nn.Parameter(w.clone(), requires_grad=False), None
    return m


class LlamaForCausalLM(nn.Module):  # the name attach() serves
    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        t = lambda name: tensors[f"model.{name}.weight"]  # noqa: E731
        self.config = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
        self.model = nn.Module()
        self.model.embed_tokens = _linear(t("embed_tokens"))
        self.model.start_layer, self.model.end_layer = 0, LAYERS
        self.model.layers = nn.ModuleList()
        for i in range(LAYERS):
            p = f"layers.{i}."
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            qkv = torch.cat([t(p + f"self_attn.{n}_proj") for n in "qkv"])
            layer.self_attn.qkv_proj, layer.self_attn.o_proj = _linear(qkv), _linear(t(p + "self_attn.o_proj"))
            gate_up = torch.cat([t(p + "mlp.gate_proj"), t(p + "mlp.up_proj")])
            layer.mlp.gate_up_proj, layer.mlp.down_proj = _linear(gate_up), _linear(t(p + "mlp.down_proj"))
            self.model.layers.append(layer)

    def linears(self) -> dict[str, nn.Module]:
        out = {"embed_tokens": self.model.embed_tokens}
        for i, layer in enumerate(self.model.layers):
            for name in ("qkv_proj", "o_proj"):
                out[f"{i}.{name}"] = getattr(layer.self_attn, name)
            for name in ("gate_up_proj", "down_proj"):
                out[f"{i}.{name}"] = getattr(layer.mlp, name)
        return out


@pytest.fixture(scope="module")
def converted() -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    folder = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    keep = ("model.embed_tokens.",) + tuple(f"model.layers.{i}." for i in range(LAYERS))
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(keep)}


def _no_float_path(*args, **kwargs):
    raise AssertionError("a GGUF layer reached SGLang's float path")


def test_layers_served_from_blocks_compute_the_float_weights(converted):
    model = LlamaForCausalLM(converted)
    floats = {name: m.weight.detach().clone() for name, m in model.linears().items()}
    freed = weights.attach(model, default_model_gguf())
    assert freed == sum(w.numel() * w.element_size() for w in floats.values())
    torch.manual_seed(0)
    for name, layer in model.linears().items():
        w, blocks = floats[name], weights.of(layer)
        assert layer.weight.numel() == 0 and blocks is not None, name
        assert torch.equal(blocks.dequantize(), w), name  # the start-up check, held here too
        for rows in (1, 5, 40):  # gemv, gemv with a row buffer, dequantized tiles
            x = torch.randn(rows, w.shape[1])
            y = decode_linear.linear_apply(_no_float_path, None, layer, x)
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
    head = model.model.embed_tokens
    h = torch.randn(3, 576)
    logits = decode_linear.compute_lm_head(_no_float_path, None, h, head)
    torch.testing.assert_close(logits, h @ floats["embed_tokens"].T, rtol=1e-4, atol=1e-4)
    ids = torch.tensor([[0, 17, 49151], [2, 2, 1000]])
    assert torch.equal(decode_linear.embedding(_no_float_path, None, head, ids), floats["embed_tokens"][ids])


def test_a_wrong_row_order_stops_the_start(converted, monkeypatch):
    monkeypatch.setattr(weights, "_unpermute", lambda w, n_head: w)  # llama.cpp's q/k order left as it is
    with pytest.raises(GGUFError, match="layers.0.qkv_proj: the decoded GGUF blocks .* differ"):
        weights.attach(LlamaForCausalLM(converted), default_model_gguf())


def test_mixed_block_types_in_one_layer_concatenate_outputs(converted):
    gguf = weights.GGUFFile(default_model_gguf())
    q, embd = gguf["blk.0.attn_q.weight"], gguf["token_embd.weight"]  # Q4_1 and Q8_0, both 576 wide
    merged = weights._stack([q, embd, q])
    assert [p.qtype.name for p in merged.parts] == ["Q4_1", "Q8_0", "Q4_1"]
    x = torch.randn(2, 576)
    torch.testing.assert_close(merged(x), F.linear(x, merged.dequantize()), rtol=1e-4, atol=1e-4)


def test_gguf_weights_need_the_default_model_and_the_cpu(tmp_path):
    folder = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    assert converted_from(folder) == default_model_gguf() and converted_from(tmp_path) is None
    refuse_gguf_weights_without_a_source(str(folder), on_gpu=False)
    with pytest.raises(SystemExit, match="is neither"):
        refuse_gguf_weights_without_a_source(str(tmp_path), on_gpu=False)
    with pytest.raises(SystemExit, match="CPU only"):
        refuse_gguf_weights_without_a_source(str(folder), on_gpu=True)
    with pytest.raises(ValueError, match="--loopkv-stock"):
        LoopKVConfig.from_flat(weights="gguf", stock=True)
    with pytest.raises(ValueError, match="float32 or gguf"):
        LoopKVConfig.from_flat(weights="q4")


def _as_sglang_gguf_layer(layer: nn.Module, raw: list, shard_ids: list | None) -> None:
    """``layer`` as SGLang's GGUF loader leaves it: the file's bytes as ``qweight`` (a merged layer's
    shards padded into one by SGLang's own ``GGUFLinearMethod``), their types in ``qweight_type``."""
    from sglang.srt.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod

    del layer.weight
    kinds = nn.Parameter(torch.zeros(len(raw), dtype=torch.uint8), requires_grad=False)
    if shard_ids is None:
        layer.qweight = nn.Parameter(raw[0].blocks.clone(), requires_grad=False)
        kinds.weight_type = int(raw[0].qtype)
    else:
        layer.qweight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.qweight.data_container = [w.blocks.clone() for w in raw]
        layer.qweight.shard_id, layer.qweight.shard_id_map = list(shard_ids), {i: j for j, i in enumerate(shard_ids)}
        kinds.shard_weight_type = {i: int(w.qtype) for i, w in zip(shard_ids, raw)}
    layer.qweight_type = kinds
    layer.quant_method = GGUFLinearMethod(GGUFConfig())
    if shard_ids is not None:
        layer.quant_method._create_padded_weight_param(layer)


def test_layers_sglang_loaded_from_the_gguf_file_are_served_from_its_blocks(converted):
    model = LlamaForCausalLM(converted)
    floats = {name: m.weight.detach().clone() for name, m in model.linears().items()}
    gguf = weights.GGUFFile(default_model_gguf())
    t = lambda i, n: gguf[f"blk.{i}.{n}.weight"]  # noqa: E731
    _as_sglang_gguf_layer(model.model.embed_tokens, [gguf["token_embd.weight"]], None)
    for i, layer in enumerate(model.model.layers):
        _as_sglang_gguf_layer(layer.self_attn.qkv_proj, [t(i, "attn_q"), t(i, "attn_k"), t(i, "attn_v")], "qkv")
        _as_sglang_gguf_layer(layer.self_attn.o_proj, [t(i, "attn_output")], None)
        _as_sglang_gguf_layer(layer.mlp.gate_up_proj, [t(i, "ffn_gate"), t(i, "ffn_up")], [0, 1])
        _as_sglang_gguf_layer(layer.mlp.down_proj, [t(i, "ffn_down")], None)
    loaded = sum(m.qweight.numel() for m in model.linears().values())
    assert weights.attach(model, default_model_gguf()) == loaded
    torch.manual_seed(0)
    for name, layer in model.linears().items():
        assert layer.qweight.numel() == 0, name  # SGLang's copy is gone: the mapped file's blocks are served
        x = torch.randn(3, floats[name].shape[1])
        y = decode_linear.gguf_linear_apply(_no_float_path, layer.quant_method, layer, x)
        torch.testing.assert_close(y, F.linear(x, floats[name]), rtol=1e-4, atol=1e-4)
    head, ids = model.model.embed_tokens, torch.tensor([[0, 17, 49151]])
    got = decode_linear.embedding(_no_float_path, SimpleNamespace(params_dtype=torch.float32), head, ids)
    assert torch.equal(got, floats["embed_tokens"][ids])


def test_blocks_sglang_loaded_that_are_not_the_files_stop_the_start(converted):
    model = LlamaForCausalLM(converted)
    gguf = weights.GGUFFile(default_model_gguf())
    v = gguf["blk.0.attn_v.weight"]
    _as_sglang_gguf_layer(model.model.layers[0].self_attn.qkv_proj, [gguf["blk.0.attn_q.weight"], v, v], "qkv")
    with pytest.raises(GGUFError, match="layers.0.qkv_proj: the blocks SGLang loaded differ from the file's"):
        weights.attach(model, default_model_gguf())
