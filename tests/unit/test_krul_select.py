"""Krul layer sharing, selection side: the streamed similarity (through the loopkv backend on fake
SGLang batches) equals the offline one from full attention matrices; LayerStats add up; greedy and
optimal pairing; the pair codecs' guarantees."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_loopkv.attention.backend import LoopKVAttnBackend
from sgl_loopkv.attention.plan import build_dense_plan
from sgl_loopkv.cache.importance import ChunkImportance
from sgl_loopkv.context import Context
from sgl_loopkv.krul.codec import CODECS
from sgl_loopkv.krul.observer import KrulObserver
from sgl_loopkv.krul.pairing import (
    brute_force_pairs,
    greedy_pairs,
    ir_layers,
    optimal_pairs,
    select_pairs,
    total_distance,
)
from sgl_loopkv.krul.similarity import LayerStats, offline_stats, row_stats
from tests.fakes import TINY_LLAMA, FakeKVPool, fake_batch, fake_layer, fake_runner, tiny_llama

LAYERS = 4
HQ, HKV, D = TINY_LLAMA["num_attention_heads"], TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["head_dim"]


# --- a tiny HF Llama whose attention we capture --------------------------------------------------
@pytest.fixture(scope="module")
def capturing_llama():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    captured: list = []

    def capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        captured.append(
            (module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), weights[0])
        )
        return out, weights

    AttentionInterface.register("krul_capture", capture)
    AttentionMaskInterface.register("krul_capture", eager_mask)  # else a custom attention gets no causal mask
    model = tiny_llama(LAYERS, vocab_size=256, attn_implementation="krul_capture")
    with torch.no_grad():  # sharper attention than the default init, so layers differ clearly
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model, captured


def hf_forwards(model, captured, tokens: list[int], chunks: list[int]):
    """Run ``tokens`` through the model in forwards of ``chunks`` sizes with a KV cache; per forward,
    per layer, the (q, k_new, v_new) the attention saw. Plus the full attention of one pass."""
    from transformers import DynamicCache

    cache, out, at = DynamicCache(), [], 0
    with torch.no_grad():
        for n in chunks:
            captured.clear()
            model(torch.tensor([tokens[at : at + n]]), past_key_values=cache, use_cache=True)
            out.append([(q, k[-n:], v[-n:]) for _, q, k, v, _ in sorted(captured, key=lambda c: c[0])])
            at += n
        captured.clear()
        model(torch.tensor([tokens[:at]]))
        full = [w for _, _, _, _, w in sorted(captured, key=lambda c: c[0])]
    return out, full


def run_backend(be, rows, seq_lens, q_lens, per_layer, decode):
    """One batched forward of the loopkv backend: per_layer[l] = (q, k, v) of all sequences' new rows."""
    r2t = be.req_to_token_pool.req_to_token
    loc = torch.cat([r2t[r, s - n : s] for r, s, n in zip(rows, seq_lens, q_lens)]).long()
    fb = fake_batch(ForwardMode.DECODE if decode else ForwardMode.EXTEND, rows, seq_lens, q_lens, loc)
    be.init_forward_metadata(fb)
    for i, (q, k, v) in enumerate(per_layer):
        call = be.forward_decode if decode else be.forward_extend
        call(q.reshape(q.shape[0], -1), k, v, fake_layer(i, HQ, D, D**-0.5), fb)


@pytest.mark.parametrize("stride", [1, 4])
def test_streamed_distance_equals_offline_distance(capturing_llama, stride):
    """Two requests: A prefills 100 tokens in two chunks (60 + 40), B 70 in one; then 5 decode
    steps batched together. Each request's board == statistics of its full attention matrices at
    the sampled positions (stride 4: multiples of 4, prefill and decode rows alike, weight 4)."""
    model, captured = capturing_llama
    g = random.Random(0)
    toks = {0: [g.randrange(256) for _ in range(105)], 3: [g.randrange(256) for _ in range(75)]}
    chunks = {0: [60, 40, 1, 1, 1, 1, 1], 3: [70, 1, 1, 1, 1, 1]}
    fw, full = {}, {}
    for r in toks:
        fw[r], full[r] = hf_forwards(model, captured, toks[r], chunks[r])

    req_to_token = torch.zeros(4, 128, dtype=torch.int32)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(1))  # scattered slots: gathers
    req_to_token[0], req_to_token[3] = perm[:128], perm[128:256]
    observer = KrulObserver()
    observer.configure(True, LAYERS, stride)
    recorded = []  # forwards whose rows reached the estimator's attention
    real_probs = observer._eager_probs
    observer._eager_probs = lambda plan, i, *a: recorded.append(plan.kv_len(i) - 1) or real_probs(plan, i, *a)
    be = LoopKVAttnBackend(
        fake_runner(req_to_token, FakeKVPool.zeros(LAYERS, 512, HKV, D)),
        context=Context(importance=ChunkImportance(), observer=observer),
    )
    run_backend(be, [0], [60], [60], fw[0][0], False)
    run_backend(
        be,
        [0, 3],
        [100, 70],
        [40, 70],
        [tuple(torch.cat(x) for x in zip(a, b)) for a, b in zip(fw[0][1], fw[3][0])],
        False,
    )
    for step in range(5):
        per_layer = [tuple(torch.cat(x) for x in zip(a, b)) for a, b in zip(fw[0][2 + step], fw[3][1 + step])]
        run_backend(be, [0, 3], [101 + step, 71 + step], [1, 1], per_layer, True)

    # decode positions: A 100..104, B 70..74; stride 4 computes only those on the grid (100, 104, 72)
    assert set(recorded) == ({100, 101, 102, 103, 104, 70, 71, 72, 73, 74} if stride == 1 else {100, 104, 72})
    for r in toks:
        streamed = observer.pop(r)
        pos = torch.arange(0, len(toks[r]), stride)
        ref = offline_stats([a[:, pos] for a in full[r]], pos)
        ref.sq_dist, ref.ir_mass, ref.rows, ref.ir_rows = (
            ref.sq_dist * stride,
            ref.ir_mass * stride,
            ref.rows * stride,
            ref.ir_rows * stride,
        )
        assert streamed.rows == ref.rows == len(pos) * stride and streamed.ir_rows == ref.ir_rows
        off = ~torch.eye(LAYERS, dtype=torch.bool)
        assert ref.distance()[off].min() > 0.5  # the layers really differ: not a vacuous comparison
        torch.testing.assert_close(streamed.distance(), ref.distance(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(streamed.sq_dist, ref.sq_dist, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(streamed.ir_score(), ref.ir_score(), rtol=1e-5, atol=1e-6)
    assert observer.pop(0) is None  # popped: the next turn starts from nothing


def test_estimator_is_off_by_default():
    """A fresh observer records nothing; on, it wants exactly the forwards with a row on its grid
    (stride 4: a decode step at position 8 yes, at 9 no); off again, nothing."""
    plan = build_dense_plan(torch.zeros(1, 16, dtype=torch.int32), [0], [9], [1])  # decode at position 8
    later = build_dense_plan(torch.zeros(1, 16, dtype=torch.int32), [0], [10], [1])  # position 9
    observer = KrulObserver()
    assert not observer.wants(0, plan)
    observer.configure(True, LAYERS, 4)
    assert observer.wants(0, plan) and observer.wants(1, plan) and not observer.wants(0, later)
    observer.configure(False)
    assert not observer.wants(0, plan)


def random_qk(seed, n_layers=3, n=90, keys=None):
    g = torch.Generator().manual_seed(seed)
    keys = keys or n
    return torch.randn(n_layers, n, HQ, D, generator=g) * 2, torch.randn(n_layers, keys, HKV, D, generator=g)


def test_layer_stats_add_up_and_round_trip_json(monkeypatch):
    q, k = random_qk(0)
    pos = torch.arange(90)
    whole = row_stats(q, k, pos, 0.25)
    parts = row_stats(q[:, :37], k, pos[:37], 0.25) + row_stats(q[:, 37:], k, pos[37:], 0.25)
    torch.testing.assert_close(parts.sq_dist, whole.sq_dist, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(parts.ir_mass, whole.ir_mass)
    assert (parts.rows, parts.ir_rows) == (whole.rows, whole.ir_rows)
    # row blocks inside one call (small BLOCK_ELEMS forces many) change nothing either
    monkeypatch.setattr("sgl_loopkv.krul.similarity.BLOCK_ELEMS", 3 * 90 * 4)
    torch.testing.assert_close(row_stats(q, k, pos, 0.25).sq_dist, whole.sq_dist, rtol=1e-6, atol=1e-8)
    back = LayerStats.from_json(whole.to_json())
    assert torch.equal(back.sq_dist, whole.sq_dist) and torch.equal(back.ir_mass, whole.ir_mass)


def test_gram_path_equals_direct_differences():
    """||a||^2 + ||b||^2 - 2ab (one matmul) == sum (a - b)^2; float32 Gram (the default) within 1e-5."""
    q, k = random_qk(1)
    pos = torch.arange(90)
    scores = torch.einsum("lnhd,lkhd->lhnk", q, k.repeat_interleave(HQ // HKV, dim=2)) * 0.25
    probs = scores.masked_fill(torch.arange(90)[None, :] > pos[:, None], float("-inf")).softmax(-1)
    ref = offline_stats(list(probs), pos)  # direct differences in float64
    torch.testing.assert_close(
        row_stats(q, k, pos, 0.25, gram_dtype=torch.float64).sq_dist, ref.sq_dist, rtol=1e-7, atol=1e-9
    )
    torch.testing.assert_close(row_stats(q, k, pos, 0.25).sq_dist, ref.sq_dist, rtol=1e-5, atol=1e-6)


def test_ir_score_is_high_for_sink_and_local_attention_only():
    """A layer attending to token 0 and the diagonal scores ~1, a uniform one ~0.2 (two 10% windows)."""
    n = 200
    pos = torch.arange(n)
    sink = torch.zeros(n, n)
    sink[:, 0] = 0.5
    sink[pos, pos] += 0.5
    uniform = torch.tril(torch.ones(n, n))
    uniform /= uniform.sum(-1, keepdim=True)
    stats = offline_stats([sink[None], uniform[None]], pos)
    score = stats.ir_score()
    assert score[0] == pytest.approx(1.0) and score[1] == pytest.approx(0.2, abs=0.02)
    assert ir_layers(stats, 0.5) == [0]


# --- pairing ----------------------------------------------------------------------------------------
def stats_from(dist: torch.Tensor, ir: list[float]) -> LayerStats:
    L = dist.shape[0]
    return LayerStats(L, 1, (dist**2).unsqueeze(-1).double(), torch.tensor(ir, dtype=torch.float64), 1.0, 1.0)


def test_greedy_reproduces_algorithm_1_on_a_hand_made_matrix():
    L = 8
    dist = torch.full((L, L), 9.0)
    for (i, j), d in {
        (2, 3): 1.0,
        (3, 4): 0.5,
        (5, 7): 2.0,
        (2, 6): 3.0,
        (6, 7): 1.5,
        (0, 1): 0.1,
        (4, 5): 2.5,
    }.items():
        dist[i, j] = dist[j, i] = d
    dist.fill_diagonal_(0)
    ir = [0.1, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]  # layers 0, 1 are not I-R: their 0.1 pair is ignored
    stats = stats_from(dist, ir)
    # ascending: (3,4) 0.5 take; (2,3) 1.0 skip; (6,7) 1.5 take; (5,7) skip; (4,5) skip; (2,6) skip; (2,5) 9 take
    assert select_pairs(stats, 0.5, 1.0, "greedy") == [(3, 4), (6, 7), (2, 5)]
    assert select_pairs(stats, 0.5, 0.5, "greedy") == [(3, 4), (6, 7)]  # stops at floor(8 * 0.5 / 2) pairs
    assert select_pairs(stats, 0.5, 0.25, "greedy") == [(3, 4)]
    assert select_pairs(stats, 0.95, 1.0, "greedy") == []  # no I-R layers
    # optimal: (2,3) + (6,7) + (4,5) = 5.0 < greedy's 0.5 + 1.5 + 9 = 11
    assert sorted(select_pairs(stats, 0.5, 1.0, "optimal")) == [(2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("seed", range(25))
def test_optimal_is_brute_force_and_never_worse_than_greedy(seed):
    g = random.Random(seed)
    L = g.randint(3, 11)
    x = torch.rand(L, L, generator=torch.Generator().manual_seed(seed))
    dist = x + x.T
    dist.fill_diagonal_(0)
    ir = [g.choice([0.2, 0.8, 0.9]) for _ in range(L)]
    ratio = g.choice([0.25, 0.5, 0.75, 1.0])
    stats = stats_from(dist, ir)
    cand = ir_layers(stats, 0.5)
    budget = min(int(L * ratio) // 2, len(cand) // 2)
    greedy, optimal = (select_pairs(stats, 0.5, ratio, m) for m in ("greedy", "optimal"))
    for pairs in (greedy, optimal):
        flat = [i for p in pairs for i in p]
        assert len(flat) == len(set(flat)) and set(flat) <= set(cand) and len(pairs) == budget
        assert all(a < b for a, b in pairs)
    d = stats.distance()
    best = total_distance(d, brute_force_pairs(d, cand, budget))
    assert total_distance(d, optimal) == pytest.approx(best, abs=1e-6)
    assert total_distance(d, optimal) <= total_distance(d, greedy) + 1e-9
    assert greedy == sorted(greedy_pairs(d, cand, budget), key=lambda p: (float(d[p]), p))


def test_brute_force_itself_is_exhaustive():
    d = torch.tensor([[0, 1, 5, 5], [1, 0, 5, 5], [5, 5, 0, 1], [5, 5, 1, 0.0]])
    assert sorted(brute_force_pairs(d, [0, 1, 2, 3], 2)) == [(0, 1), (2, 3)]
    assert sorted(optimal_pairs(d, [0, 1, 2, 3], 1)) in ([(0, 1)], [(2, 3)])
    combos = list(itertools.combinations(range(4), 2))
    assert min(float(d[p]) for p in combos) == total_distance(d, brute_force_pairs(d, [0, 1, 2, 3], 1))


# --- codecs -----------------------------------------------------------------------------------------
def kv_pair(seed, T=64, H=3, noise=0.3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, T, H, 32, generator=g) * torch.rand(1, T, H, 1, generator=g) * 4
    b = a + noise * torch.randn(2, T, H, 32, generator=g) * a.norm(dim=-1, keepdim=True) / 32**0.5
    b[:, 5] = torch.randn(2, H, 32, generator=g)  # an outlier token the merge should keep verbatim
    return a.to(dtype), b.to(dtype)


def test_reuse_restores_shallow_bit_exactly():
    a, b = kv_pair(0)
    codec = CODECS.create("reuse")
    row, side = codec.encode(a, b)
    s, d = codec.decode(row, side)
    assert torch.equal(s, a) and torch.equal(d, a) and side == {} and row.dtype == a.dtype


@pytest.mark.parametrize("t", [0.0, 0.5, 0.6])
def test_minicache_guarantees(t):
    a, b = kv_pair(1)
    codec = CODECS.create("minicache", t=t, retain=0.05)
    row, side = codec.encode(a, b)
    assert row.shape == a.shape and row.dtype == a.dtype
    s, d = codec.decode(row, side)
    torch.testing.assert_close(s.norm(dim=-1), a.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d.norm(dim=-1), b.norm(dim=-1), rtol=1e-5, atol=1e-6)
    kept = side["kept_pos"]
    assert len(kept) == round(0.05 * 64) and 5 in kept.tolist()  # the outlier is kept
    assert torch.equal(s[:, kept], a[:, kept]) and torch.equal(d[:, kept], b[:, kept])
    if t == 0:
        assert torch.equal(s, a)
    # merged tokens: cosine >= cos(max(t, 1 - t) * largest merged angle), per (K/V, token, head)
    merged = torch.ones(64, dtype=torch.bool)
    merged[kept] = False
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)[:, merged]
    bound = torch.cos(max(t, 1 - t) * torch.arccos(cos.clamp(-1, 1)).max())
    for x, y in ((s, a), (d, b)):
        assert torch.nn.functional.cosine_similarity(x, y, dim=-1)[:, merged].min() >= bound - 1e-5
    err = (d - b).norm() / b.norm()
    assert err < 0.3  # and it is a real approximation, not a copy
    assert err > 0 or t == 1


def test_minicache_on_identical_layers_restores_both():
    a, _ = kv_pair(2)
    codec = CODECS.create("minicache")
    s, d = codec.decode(*codec.encode(a, a.clone()))
    torch.testing.assert_close(s, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["reuse", "minicache"])
@pytest.mark.parametrize("cut", [(0, 16), (16, 48), (48, 64), (0, 64)])
def test_decode_of_a_sliced_encode_is_the_slice_of_the_decode(name, cut):
    a, b = kv_pair(3)
    codec = CODECS.create(name)
    row, side = codec.encode(a, b)
    full_s, full_d = codec.decode(row, side)
    t0, t1 = cut
    s, d = codec.decode(row[:, t0:t1], codec.slice_side(side, t0, t1))
    assert torch.equal(s, full_s[:, t0:t1]) and torch.equal(d, full_d[:, t0:t1])


def test_minicache_keeps_bf16_rows_in_bf16():
    a, b = kv_pair(4, dtype=torch.bfloat16)
    codec = CODECS.create("minicache")
    row, side = codec.encode(a, b)
    s, d = codec.decode(row, side)
    assert row.dtype == s.dtype == d.dtype == torch.bfloat16
    assert torch.nn.functional.cosine_similarity(d.float(), b.float(), dim=-1).mean() > 0.95
