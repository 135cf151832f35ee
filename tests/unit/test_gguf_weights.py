"""``--loopkv-weights gguf`` (``sgl_loopkv/models/gguf/weights.py``): the default model's layers served from its
GGUF blocks compute what the converted float weights compute, through the decode-linear hooks.

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
    with pytest.raises(SystemExit, match="default model only"):
        refuse_gguf_weights_without_a_source(str(tmp_path), on_gpu=False)
    with pytest.raises(SystemExit, match="CPU only"):
        refuse_gguf_weights_without_a_source(str(folder), on_gpu=True)
    with pytest.raises(ValueError, match="--loopkv-stock"):
        LoopKVConfig.from_flat(weights="gguf", stock=True)
    with pytest.raises(ValueError, match="float32 or gguf"):
        LoopKVConfig.from_flat(weights="q4")
