"""Shared fakes: the few SGLang objects the loopkv attention backend touches (model runner, KV pool,
RadixAttention layer, ForwardBatch), and the one tiny random-weight Llama every model-level test builds.

The fakes carry exactly the attributes the backend reads; a new attribute read by the backend
fails here first, with an AttributeError naming it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

#: The tiny Llama's geometry (GQA 4:2, head_dim 16); tests choose layers and vocabulary.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def tiny_llama(num_layers: int, vocab_size: int, seed: int = 0, **overrides):
    """A random-weight ``LlamaForCausalLM`` (float32, eval) of :data:`TINY_LLAMA` geometry, seeded.

    ``overrides`` go to ``LlamaConfig`` (``attn_implementation``, ``max_position_embeddings``,
    ``tie_word_embeddings``...). The tests' servers serve one saved with SmolLM2's tokenizer
    (``tests/e2e/conftest.py``); the restore and Krul tests run it in-process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        **{"max_position_embeddings": 1024, **TINY_LLAMA, **overrides},
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


class FakeKVPool:
    """SGLang's KV pool as the attention backend uses it: per layer, K and V buffers
    [slots, num_kv_heads, head_dim]; ``set_kv_buffer`` writes the new rows at their slots."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v

    @classmethod
    def zeros(cls, layers: int, slots: int, kv_heads: int, head_dim: int) -> FakeKVPool:
        return cls(
            [torch.zeros(slots, kv_heads, head_dim) for _ in range(layers)],
            [torch.zeros(slots, kv_heads, head_dim) for _ in range(layers)],
        )

    @classmethod
    def random(cls, seed: int, layers: int, slots: int, kv_heads: int, head_dim: int) -> FakeKVPool:
        g = torch.Generator().manual_seed(seed)
        kv = [[torch.randn(slots, kv_heads, head_dim, generator=g) for _ in "kv"] for _ in range(layers)]
        return cls([k for k, _ in kv], [v for _, v in kv])

    def set_kv_buffer(self, layer, loc, k, v):
        kv_heads, head_dim = self.k[layer.layer_id].shape[1:]
        self.k[layer.layer_id][loc.loc] = k.view(-1, kv_heads, head_dim)
        self.v[layer.layer_id][loc.loc] = v.view(-1, kv_heads, head_dim)

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]


def fake_runner(req_to_token: torch.Tensor, pool: FakeKVPool) -> SimpleNamespace:
    """A ModelRunner as the backend's constructor reads it: ``req_to_token`` [rows, max_len] int32 slots."""
    return SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
        server_args=SimpleNamespace(enable_metrics=False),
    )


def fake_layer(layer_id: int, q_heads: int, head_dim: int, scale: float) -> SimpleNamespace:
    """A RadixAttention layer: plain causal self-attention (no sliding window, no logit cap)."""
    return SimpleNamespace(
        layer_id=layer_id,
        is_cross_attention=False,
        sliding_window_size=-1,
        logit_cap=0.0,
        tp_q_head_num=q_heads,
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        scaling=scale,
    )


def fake_batch(mode, rows: list[int], seq_lens: list[int], q_lens: list[int], out_cache_loc: torch.Tensor):
    """A ForwardBatch: ``rows`` of the request table, each sequence's total and new lengths (tokens)."""
    return SimpleNamespace(
        forward_mode=mode,
        batch_size=len(rows),
        seq_lens_cpu=torch.tensor(seq_lens),
        seq_lens=torch.tensor(seq_lens),
        req_pool_indices_cpu=torch.tensor(rows),
        extend_seq_lens_cpu=q_lens,
        out_cache_loc=out_cache_loc,
    )
