"""The split-bfloat16 prefill attention (``kernels/prefill_attention.cpp``): float32 queries over bfloat16
keys and values within a few hundredths of a percent of a float64 softmax over the same keys with split
softmax weights, within bfloat16's rounding of the weights (2^-9) with them rounded once, for
causal extends of any length over any prefix (GQA, head dims 64 and 128, strided pool views), a row's
result independent of the thread count, bad operands refused with a message, and ``dense_attention``
taking it only where it applies: bfloat16 prefills (``--loopkv-prefill-dtype``) over a bfloat16 pool (the
float32 path's attention, and float32 mode's, stay torch's)."""

from __future__ import annotations

import pytest
import torch

from sgl_loopkv.attention import executor
from sgl_loopkv.kernels import prefill_attention
from sgl_loopkv.models import precision

#: Bound on |ours - float64| over max |v|: the split keeps 16 of float32's 24 mantissa bits of q and of
#: the softmax weights (relative error <= 2^-17 each), here with scores of standard deviation ~4.
TOL = 2.0**-12
#: The same with the softmax weights rounded to bfloat16 once: each weight within 2^-9 of itself and the
#: normalizer their float32 sum, so the output moves by at most 2^-9 of max |v| beyond the split's bound.
TOL_ROUNDED = TOL + 2.0**-9


@pytest.fixture(scope="module")
def mod():
    module = prefill_attention.load()
    if module is None:
        pytest.skip("no C++ toolchain: the prefill attention kernel is unavailable")
    if not module.available():
        pytest.skip("no bfloat16 brgemm on this CPU (AMX-BF16 or AVX512-BF16)")
    return module


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal softmax attention: q [n, Hq, D] at positions L - n .., k, v [L, Hkv, D]."""
    n, L = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    qh = q.double().transpose(0, 1)
    kh = k.double().transpose(0, 1).repeat_interleave(g, 0)
    vh = v.double().transpose(0, 1).repeat_interleave(g, 0)
    s = qh @ kh.transpose(1, 2) * scale
    masked = torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None]
    return (s.masked_fill(masked, float("-inf")).softmax(-1) @ vh).transpose(0, 1)


def operands(n: int, L: int, hq: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g) * 2
    k = (torch.randn(L, hkv, d, generator=g) * 2).bfloat16()
    v = torch.randn(L, hkv, d, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize(
    "n,L,hq,hkv,d",
    [
        (1, 1, 4, 4, 64),
        (64, 64, 9, 3, 64),
        (100, 300, 9, 3, 64),
        (257, 257, 8, 2, 64),  # a row block and a key tile past their multiples
        (64, 2000, 9, 3, 64),  # a short extend over a long prefix
        (700, 1500, 4, 4, 128),
    ],
)
def test_matches_float64(mod, n, L, hq, hkv, d):
    q, k, v = operands(n, L, hq, hkv, d)
    scale = d**-0.5
    ref = reference(q, k, v, scale)
    split = mod.flash_split(q, k, v, scale, True)
    assert torch.equal(split, mod.flash_split(q, k, v, scale))  # split is the kernel's default
    err = (split.double() - ref).abs().max().item()
    assert err <= TOL * v.float().abs().max().item(), err
    rounded = mod.flash_split(q, k, v, scale, False)
    err = (rounded.double() - ref).abs().max().item()
    assert err <= TOL_ROUNDED * v.float().abs().max().item(), err


def test_rounded_weights_are_bfloat16s_rounding_not_more():
    """Rounding the weights once is a real rounding: on values all of one sign, where the weights'
    errors do not cancel, it is measurably further from float64 than the split (so the bound above is
    not a bound either path meets trivially), and still within it."""
    module = prefill_attention.load()
    if module is None or not module.available():
        pytest.skip("no prefill attention kernel here")
    q, k, _ = operands(256, 1024, 9, 3, 64, seed=5)
    v = (torch.rand(1024, 3, 64, generator=torch.Generator().manual_seed(6)) + 1).bfloat16()
    ref = reference(q, k, v, 0.125)
    split = (module.flash_split(q, k, v, 0.125, True).double() - ref).abs().max().item()
    rounded = (module.flash_split(q, k, v, 0.125, False).double() - ref).abs().max().item()
    vmax = v.float().abs().max().item()
    assert split <= TOL * vmax and rounded <= TOL_ROUNDED * vmax, (split, rounded)
    assert rounded > 4 * split, (split, rounded)


@pytest.mark.parametrize("split", [True, False])
def test_strided_pool_views(mod, split):
    """Keys and values as a slice of a pool's rows and heads; queries as a head slice."""
    q, k, v = operands(300, 500, 12, 6, 64, seed=1)
    pool_k = torch.zeros(700, 8, 64, dtype=torch.bfloat16)
    pool_v = torch.zeros(700, 8, 64, dtype=torch.bfloat16)
    pool_k[100:600, 1:7], pool_v[100:600, 1:7] = k, v
    wide_q = torch.zeros(300, 16, 64)
    wide_q[:, 2:14] = q
    ours = mod.flash_split(wide_q[:, 2:14], pool_k[100:600, 1:7], pool_v[100:600, 1:7], 0.125, split)
    assert torch.equal(ours, mod.flash_split(q, k, v, 0.125, split))


@pytest.mark.parametrize("split", [True, False])
def test_rows_independent_of_threads(mod, split):
    q, k, v = operands(400, 900, 9, 3, 64, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mod.flash_split(q, k, v, 0.125, split)
        torch.set_num_threads(max(2, before))
        many = mod.flash_split(q, k, v, 0.125, split)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v: (q, k.float(), v.float()), "bfloat16"),
        (lambda q, k, v: (q.bfloat16(), k, v), "float32"),
        (lambda q, k, v: (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous()), "head dim"),
        (lambda q, k, v: (q, k[:, :2], v[:, :2]), "Hq a multiple"),
        (lambda q, k, v: (torch.cat([q, q]), k[:10], v[:10]), "n <= L"),
    ],
)
def test_bad_operands_refused(mod, change, message):
    q, k, v = change(*operands(16, 32, 9, 3, 64))
    with pytest.raises(RuntimeError, match=message):
        mod.flash_split(q, k, v, 0.125)


def test_dense_attention_routes_only_a_bf16_pools_prefill_in_bfloat16_mode(monkeypatch):
    mod = executor.prefill_kernel()
    if mod is None:
        pytest.skip("no bfloat16 units or no kernel here: dense_attention keeps torch's flash kernel")
    monkeypatch.delenv(precision.ENV, raising=False)
    monkeypatch.delenv(precision.SOFTMAX_ENV, raising=False)
    q, k, v = operands(128, 200, 9, 3, 64, seed=3)
    kf, vf = k.float(), v.float()
    torch_f32 = executor.dense_attention(q, kf, vf, 0.125)  # a float32 pool: torch's kernel in any mode
    try:
        precision.use("float32")
        assert torch.equal(executor.dense_attention(q, k, v, 0.125), torch_f32)
        precision.use("bfloat16")  # softmax weights split, the default
        assert torch.equal(executor.dense_attention(q, k, v, 0.125), mod.flash_split(q, k, v, 0.125, True))
        precision.use("bfloat16", "bfloat16")
        assert torch.equal(executor.dense_attention(q, k, v, 0.125), mod.flash_split(q, k, v, 0.125, False))
        assert torch.equal(executor.dense_attention(q, kf, vf, 0.125), torch_f32)
        assert not torch.equal(torch_f32, mod.flash_split(q, k, v, 0.125))
        # a short extend keeps torch's kernel
        short = executor.dense_attention(q[:32], k, v, 0.125)
        assert torch.equal(short, executor.dense_attention(q[:32], kf, vf, 0.125))
    finally:
        precision.use("float32")
