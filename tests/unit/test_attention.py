"""The dense loopkv attention (plan + torch executor) against a hand-written masked reference and
against SGLang's own torch_native backend, on random tensors."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_loopkv.attention import EXECUTORS, AttentionPlan, build_dense_plan, dense_attention


def reference_attention(q, k, v, scale, causal=True):
    """softmax(q k^T * scale + mask) v with explicit GQA expansion and an explicit causal mask."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    if causal:
        allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("n,L", [(1, 1), (1, 37), (5, 37), (37, 37), (64, 300)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
def test_dense_attention_matches_reference(n, L, hq, hkv):
    g = torch.Generator().manual_seed(n * 1000 + L)
    q = torch.randn(n, hq, 16, generator=g)
    k, v = torch.randn(L, hkv, 16, generator=g), torch.randn(L, hkv, 16, generator=g)
    torch.testing.assert_close(dense_attention(q, k, v, 0.25), reference_attention(q, k, v, 0.25), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        dense_attention(q, k, v, 0.25, causal=False),
        reference_attention(q, k, v, 0.25, causal=False),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("fused", [True, False], ids=["lse-merge", "masked-sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_over_cached_prefix_both_paths(fused, dtype, monkeypatch):
    """An extend over a cached prefix merges an unmasked prefix part and a causal part by their
    log-sum-exp when torch has the flash op, else one masked SDPA call: both equal the reference."""
    from sgl_loopkv.attention import executor

    if not fused:
        monkeypatch.setattr(executor, "_FLASH_LSE", None)
    elif executor._FLASH_LSE is None:
        pytest.skip("this torch has no CPU flash op with log-sum-exp")
    else:  # small shapes for the test: take the merge path whatever the row count
        monkeypatch.setattr(executor, "LSE_MERGE_MIN_ROWS", 1)
    g = torch.Generator().manual_seed(7)
    n, L = 48, 200
    q = torch.randn(n, 9, 32, generator=g).to(dtype)
    k, v = torch.randn(L, 3, 32, generator=g).to(dtype), torch.randn(L, 3, 32, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = reference_attention(q.float(), k.float(), v.float(), 0.2)
    torch.testing.assert_close(dense_attention(q, k, v, 0.2).float(), ref, atol=tol, rtol=tol)


def _random_batch(seed, seq_lens, q_lens, pool=1024, hq=6, hkv=2, d=8):
    """A pool with randomly placed slots per request, as SGLang's allocator leaves them."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    req_to_token = torch.zeros(8, 512, dtype=torch.int32)
    perm = torch.randperm(pool, generator=g)
    rows, used = [3, 0, 5][: len(seq_lens)], 0
    for r, n in zip(rows, seq_lens):
        req_to_token[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    return q, k_cache, v_cache, req_to_token, rows


@pytest.mark.parametrize("seq_lens,q_lens", [([40, 7, 100], [40, 2, 1]), ([1, 1, 9], [1, 1, 1]), ([64], [16])])
def test_executor_runs_plan_per_sequence(seq_lens, q_lens):
    q, k_cache, v_cache, req_to_token, rows = _random_batch(1, seq_lens, q_lens)
    plan = build_dense_plan(req_to_token, rows, seq_lens, q_lens)
    out = EXECUTORS.create("torch").run(plan, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    for i, (r, n) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[r, :n].long()
        rows_i = slice(plan.qo_indptr[i], plan.qo_indptr[i + 1])
        ref = reference_attention(q[rows_i], k_cache[slots], v_cache[slots], 0.3)
        torch.testing.assert_close(out[rows_i], ref, atol=1e-5, rtol=1e-5)


def test_plan_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="queries"):
        AttentionPlan([0, 5], [0, 3], torch.arange(3))


def test_plan_prefix_lengths():
    plan = build_dense_plan(torch.arange(40).view(2, 20), [1, 0], [12, 5], [2, 5])
    assert [plan.prefix_len(i) for i in range(2)] == [10, 0]
    assert plan.kv_slots(0).tolist() == list(range(20, 32))


@pytest.mark.parametrize("seq_lens,prefix_lens", [([40, 7, 100], [0, 5, 99]), ([300], [200])])
def test_equal_to_sglang_torch_native(seq_lens, prefix_lens):
    """Same numbers as SGLang's torch_native extend/decode (which pads q to the full sequence)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    native = object.__new__(TorchNativeAttnBackend)  # its _run_* helpers use only their arguments
    q_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
    q, k_cache, v_cache, req_to_token, rows = _random_batch(2, seq_lens, q_lens)
    as_t = lambda xs: torch.tensor(xs)  # noqa: E731
    ref = native._run_sdpa_forward_extend(
        q,
        torch.empty_like(q),
        k_cache,
        v_cache,
        req_to_token,
        as_t(rows),
        as_t(seq_lens),
        as_t(prefix_lens),
        as_t(q_lens),
        scaling=0.3,
        enable_gqa=True,
        causal=True,
    )
    plan = build_dense_plan(req_to_token, rows, seq_lens, q_lens)
    out = EXECUTORS.create("torch").run(plan, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    # decode: one new row per sequence
    qd = q[: len(seq_lens)].clone()
    ref_d = native._run_sdpa_forward_decode(
        qd,
        torch.empty_like(qd),
        k_cache,
        v_cache,
        req_to_token,
        as_t(rows),
        as_t(seq_lens),
        scaling=0.3,
        enable_gqa=True,
    )
    plan_d = build_dense_plan(req_to_token, rows, seq_lens, [1] * len(seq_lens))
    out_d = EXECUTORS.create("torch").run(plan_d, qd, k_cache, v_cache, 0.3, torch.empty_like(qd))
    torch.testing.assert_close(out_d, ref_d, atol=1e-5, rtol=1e-5)


def test_unknown_executor_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown attention executor 'nope'"):
        EXECUTORS.create("nope")


def test_contiguous_slots_are_read_through_a_view_with_the_same_result():
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[0, :40] = torch.arange(100, 140, dtype=torch.int32)  # one ascending run
    req_to_token[1, :40] = torch.arange(100, 140, dtype=torch.int32).flip(0)  # not a run
    plan = build_dense_plan(req_to_token, [0, 1], [40, 40], [3, 3])
    assert plan.runs(0) == [(100, 40)]
    assert plan.runs(1) == [(139 - j, 1) for j in range(40)]  # descending: one run per slot
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, q = torch.randn(200, 2, 8, generator=g), torch.randn(200, 2, 8, generator=g), torch.randn(6, 4, 8)
    out = EXECUTORS.create("torch").run(plan, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    for i in range(2):
        slots = req_to_token[i, :40].long()
        ref = reference_attention(q[3 * i : 3 * i + 3], k_cache[slots], v_cache[slots], 0.3)
        torch.testing.assert_close(out[3 * i : 3 * i + 3], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,hq,hkv", [(1, 9, 3), (5, 4, 4), (64, 6, 2)])
def test_attention_over_pool_runs_equals_reference(n, hq, hkv):
    """Paged slots (runs of 16, shuffled pages) read run by run: same numbers as a gather."""
    from sgl_loopkv.attention.executor import attention_over_runs
    from sgl_loopkv.attention.plan import slot_runs

    g = torch.Generator().manual_seed(n)
    pages = torch.randperm(40, generator=g)[:12]
    slots = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in pages.tolist()])[:180]
    runs = slot_runs(slots)
    assert runs is not None and sum(r[1] for r in runs) == 180 and len(runs) > 1
    k_cache, v_cache = torch.randn(640, hkv, 8, generator=g), torch.randn(640, hkv, 8, generator=g)
    q = torch.randn(n, hq, 8, generator=g)
    ref = reference_attention(q, k_cache[slots], v_cache[slots], 0.3)
    torch.testing.assert_close(attention_over_runs(q, k_cache, v_cache, runs, 0.3, True), ref, atol=1e-5, rtol=1e-5)
    plan = build_dense_plan(slots.view(1, -1).to(torch.int32), [0], [180], [n])
    out = EXECUTORS.create("torch").run(plan, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_over_pool_runs_in_half_precision(dtype):
    """A half-precision pool (bf16 on CPU, fp16/bf16 on GPU) read run by run: no dtype error, and
    the reference's numbers within half-precision rounding."""
    from sgl_loopkv.attention.executor import attention_over_runs
    from sgl_loopkv.attention.plan import slot_runs

    g = torch.Generator().manual_seed(7)
    slots = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in (5, 2, 9, 0)])
    k_cache, v_cache = torch.randn(160, 2, 16, generator=g), torch.randn(160, 2, 16, generator=g)
    q = torch.randn(3, 6, 16, generator=g)
    ref = reference_attention(q, k_cache[slots], v_cache[slots], 0.25)
    half = [t.to(dtype) for t in (q, k_cache, v_cache)]
    out = attention_over_runs(*half, slot_runs(slots), 0.25, True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_a_float32_model_over_a_bf16_pool_keeps_float32_arithmetic():
    """``--kv-cache-dtype bf16`` under a float32 model: the pool's values are bf16, but the torch decode
    paths (pool runs, gathered keys) compute in float32 like the native kernel and SGLang's torch_native,
    so the result is the reference over the bf16-rounded K/V within float32 rounding, not bf16's."""
    from sgl_loopkv.attention.executor import attention_over_runs, gathered_decode
    from sgl_loopkv.attention.plan import slot_runs

    g = torch.Generator().manual_seed(11)
    slots = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in (5, 2, 9, 0)])
    k_cache = torch.randn(160, 2, 16, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(160, 2, 16, generator=g).to(torch.bfloat16)
    for n in (1, 3):
        q = torch.randn(n, 6, 16, generator=g)
        ref = reference_attention(q, k_cache[slots].float(), v_cache[slots].float(), 0.25)
        out = attention_over_runs(q, k_cache, v_cache, slot_runs(slots), 0.25, True)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    one = gathered_decode(q[-1:], k_cache[slots], v_cache[slots], 0.25)
    torch.testing.assert_close(one, ref[-1:], atol=1e-5, rtol=1e-5)
