"""benchmarks/decode.py helpers: the arithmetic its tables rest on (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.decode import gguf_fidelity, limit_tpot_ms, model_facts, percentile, token_intervals


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    xs = list(rng.exponential(size=37))
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_token_intervals_steady_window_and_multi_token_chunks():
    # stream a: a 2-token chunk at t=3; stream b starts later and ends later
    a = [(0.0, 1), (1.0, 2), (2.0, 3), (3.0, 5)]
    b = [(0.5, 1), (1.5, 2), (2.5, 3), (3.5, 4)]
    got, tok_s = token_intervals([a, b])
    # window [0.5, 3.0]: a's 1->2, 2->3 (two tokens of 0.5 s), b's 1.5, 2.5; not a's first gap or b's last
    assert sorted(got) == [0.5, 0.5, 1.0, 1.0, 1.0]
    assert tok_s == pytest.approx(5 / 2.5)
    every, _ = token_intervals([a, b], steady=False)
    assert len(every) == 4 + 3  # every token after each stream's first chunk


@pytest.mark.parametrize("tie", [True, False])
def test_limit_counts_tied_embeddings_once(tmp_path, tie):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    cfg.save_pretrained(tmp_path)
    f = model_facts(tmp_path)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64  # q,o + k,v + mlp + two norms
    assert f["params"] == 1000 * 64 * (1 if tie else 2) + 2 * per_layer + 64
    assert (f["layers"], f["kv_heads"], f["head_dim"]) == (2, 2, 16)
    bw = 1e9
    kv = 2 * 2 * 2 * 16  # layers x (K, V) x kv heads x head dim, per byte of dtype
    # bs 3 at context 100 with 8 generated tokens: weights once + 3 x KV of 104 tokens on average
    expect = (f["params"] * 2 + 3 * kv * 2 * 104) / bw * 1000
    assert limit_tpot_ms(f, "bfloat16", 100, 3, 8, bw) == pytest.approx(expect)
    assert limit_tpot_ms(f, "float32", 100, 3, 8, bw) == pytest.approx(2 * expect)


def test_gguf_fidelity_pools_a_lengths_contexts():
    """Per length: each path's agreement averaged over the length's contexts (``L``, ``L#i``), the worse
    path's kept; KL the largest; one context per length (older results) reads as before."""

    def slot(tf, step, kl):
        sc = {"teacher_forced_agreement": tf, "step_teacher_forced_agreement": step, "first_token_kl": kl}
        return {"scores": {"loopkv-gguf": {**sc, "step_kl_max": kl / 2}}}

    fid = {
        "2048": slot(0.984, 1.0, 0.001),
        "2048#1": slot(1.0, 0.992, 0.003),
        "2048#2": slot(1.0, 1.0, 0.002),
        "8000": slot(0.992, 1.0, 0.0005),
    }
    tfs, kls = gguf_fidelity(fid, "loopkv-gguf")
    assert tfs["2048"] == pytest.approx(min((0.984 + 1 + 1) / 3, (1 + 0.992 + 1) / 3))
    assert tfs["8000"] == pytest.approx(0.992)
    assert kls == {"2048": 0.003, "8000": 0.0005}
    assert gguf_fidelity(fid, "loopkv-gguf-q8") == ({}, {})
