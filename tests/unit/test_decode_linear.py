"""Decode-step linear layers: ``gemv_f32`` / ``gemv_bf16`` (few float32 / bfloat16 rows: at least as
close to the exact sum as ``F.linear``, the same bits in any batch and thread split), the split over
torch's threads (bitwise ``F.linear``; all of it under ``LOOPKV_EXACT_LINEAR=1``), the rule that
picks them, and the SGLang hooks' fallbacks."""

from __future__ import annotations

import shutil
import types

import pytest
import torch
import torch.nn.functional as F

from sgl_loopkv.kernels import decode_linear
from sgl_loopkv.models import decode_linear as hooks


@pytest.fixture(scope="module")
def native():
    module = decode_linear.load()
    if module is None:
        pytest.skip("no C++ toolchain: the split kernel is unavailable (linear() is F.linear then)")
    return module


@pytest.fixture
def exact(monkeypatch):
    """``LOOPKV_EXACT_LINEAR=1``: every call F.linear's bits (the split, no gemv kernel)."""
    monkeypatch.setenv(decode_linear.EXACT_ENV, "1")
    decode_linear.gemv_for.cache_clear()
    yield
    monkeypatch.delenv(decode_linear.EXACT_ENV)
    decode_linear.gemv_for.cache_clear()


@pytest.fixture
def gemv(native):
    if not native.has_gemv():
        pytest.skip("gemv_f32 needs AVX-512 (linear() takes the split there)")
    return native


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def gemv_dtype(native, request):
    """Each dtype with a gemv kernel compiled here (bf16: AVX512-BF16)."""
    if not (native.has_gemv() if request.param == torch.float32 else native.has_gemv_bf16()):
        pytest.skip(f"no gemv kernel for {request.param} on this CPU (linear() takes the split there)")
    return request.param


def test_kernel_builds_where_a_compiler_exists():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert decode_linear.load() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (192, 576), (1000, 64)])
def test_exact_mode_is_bitwise_f_linear(native, exact, dtype, shape):
    """Every row count it takes, with and without bias: the split where the probe found it exact,
    F.linear elsewhere; either way the caller sees F.linear's bits."""
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g).to(dtype)
    b = torch.randn(shape[0], generator=g).to(dtype)
    for rows in [*range(1, 17), 32, 64, decode_linear.MAX_ROWS]:
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        assert torch.equal(decode_linear.linear(x, w), F.linear(x, w)), rows
        assert torch.equal(decode_linear.linear(x, w, b), F.linear(x, w, b)), rows


def test_split_taken_for_one_row(native):
    """The case it exists for (a decode step of one sequence) takes the split on these CPUs."""
    w = torch.randn(1536, 576)
    assert decode_linear.split_is_exact(1, w, None)
    assert torch.equal(native.decode_linear(torch.ones(1, 576), w, None), F.linear(torch.ones(1, 576), w))


@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (192, 576), (1000, 64), (70, 100), (33, 7), (5, 49)])
def test_gemv_is_closer_to_the_exact_sum(gemv, shape):
    """float32 rows 1..GEMV_MAX_ROWS go to gemv_f32: every output within float32's error bound of
    the float64 sum (a lost block or tail would be off by O(1)), K % 16 tails and odd 16-blocks
    included; and from K = 64 on, on the whole no farther from it than F.linear (for a handful of
    terms the two orders are equally good)."""
    g = torch.Generator().manual_seed(shape[1])
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    ours, mkl = [], []
    for rows in range(1, decode_linear.GEMV_MAX_ROWS[torch.float32] + 1):
        x = torch.randn(rows, shape[1], generator=g)
        assert decode_linear.takes_gemv(rows, w)
        for bias in (None, b):
            y = decode_linear.linear(x, w, bias)
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            bound = x.abs().double() @ w.abs().double().T + (0 if bias is None else b.abs().double())
            bound *= (shape[1] // 16 + 34) * 2.0**-24
            assert ((y.double() - ref).abs() <= bound).all(), (rows, bias is None)
            ours.append((y.double() - ref).abs().mean())
            mkl.append((F.linear(x, w, bias).double() - ref).abs().mean())
    if shape[1] >= 64:
        assert sum(ours) <= 1.05 * sum(mkl), (sum(ours), sum(mkl))


@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (192, 576), (1000, 64), (70, 100), (33, 7), (5, 49)])
def test_gemv_bf16_is_as_close_to_the_exact_sum(native, shape):
    """bfloat16 rows 1..GEMV_MAX_ROWS go to gemv_bf16: every output within half a bf16 unit of the
    float64 sum plus float32's error bound for the sum (a lost block or K % 32 tail would be off by
    O(1)), and on the whole no farther from it than F.linear (oneDNN): both round one float32 sum."""
    if not native.has_gemv_bf16():
        pytest.skip("gemv_bf16 needs AVX512-BF16")
    g = torch.Generator().manual_seed(shape[1])
    w, b = torch.randn(*shape, generator=g).bfloat16(), torch.randn(shape[0], generator=g).bfloat16()
    ours, onednn = [], []
    for rows in range(1, decode_linear.GEMV_MAX_ROWS[torch.bfloat16] + 1):
        x = torch.randn(rows, shape[1], generator=g).bfloat16()
        assert decode_linear.takes_gemv(rows, w)
        for bias in (None, b):
            y = decode_linear.linear(x, w, bias)
            assert y.dtype == torch.bfloat16
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            mag = x.abs().double() @ w.abs().double().T + (0 if bias is None else b.abs().double())
            bound = ref.abs() * 2.0**-8 + mag * (shape[1] // 32 + 34) * 2.0**-24 * (1 + 2.0**-8)
            assert ((y.double() - ref).abs() <= bound).all(), (rows, bias is None)
            ours.append((y.double() - ref).abs().mean())
            onednn.append((F.linear(x, w, bias).double() - ref).abs().mean())
    assert sum(ours) <= 1.05 * sum(onednn), (sum(ours), sum(onednn))


@pytest.mark.parametrize("shape", [(3072, 576), (1001, 120)])
def test_gemv_rows_do_not_depend_on_the_batch_or_threads(gemv_dtype, shape):
    """A row's result is the same bits alone (the one-pass kernel), in any batch of up to
    GEMV_MAX_ROWS rows (the register tiles, every remainder of 4 rows of x) and with one or two threads
    (a decode step's tokens do not change with the requests beside them). (1001, 120): a remainder of
    weight rows past the last tile of 4, an odd count of blocks and a tail in both dtypes."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(*shape, generator=g).to(gemv_dtype), torch.randn(shape[0], generator=g).to(gemv_dtype)
    x = torch.randn(decode_linear.GEMV_MAX_ROWS[gemv_dtype], shape[1], generator=g).to(gemv_dtype)
    alone = torch.cat([decode_linear.linear(x[i : i + 1], w, b) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(decode_linear.linear(x[:rows], w, b), alone[:rows]), rows
        assert torch.equal(decode_linear.linear(x[len(x) - rows :], w, b), alone[len(x) - rows :]), rows
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert decode_linear.applies(x, w)  # one thread: still gemv (nothing to split, but faster than MKL)
        assert torch.equal(decode_linear.linear(x, w, b), alone)
    finally:
        torch.set_num_threads(prev)


def test_gemv_rule(gemv, monkeypatch):
    w = torch.randn(64, 32)
    top = decode_linear.GEMV_MAX_ROWS[torch.float32]
    assert decode_linear.takes_gemv(top, w)
    assert not decode_linear.takes_gemv(top + 1, w)  # MKL's gemm (the split)
    assert decode_linear.takes_gemv(1, w.to(torch.bfloat16)) == gemv.has_gemv_bf16()
    assert not decode_linear.takes_gemv(1, w.to(torch.float16))  # float16: the split
    x3 = torch.randn(2, 3, 32)  # leading dims kept
    assert torch.equal(decode_linear.linear(x3, w), decode_linear.linear(x3.reshape(6, 32), w).view(2, 3, 64))
    monkeypatch.setenv(decode_linear.EXACT_ENV, "1")
    decode_linear.gemv_for.cache_clear()
    try:
        assert not decode_linear.takes_gemv(1, w) and not decode_linear.takes_gemv(1, w.to(torch.bfloat16))
        x = torch.randn(3, 32)
        assert torch.equal(decode_linear.linear(x, w), F.linear(x, w))
    finally:
        monkeypatch.delenv(decode_linear.EXACT_ENV)
        decode_linear.gemv_for.cache_clear()


def test_inexact_shape_keeps_f_linear(native, exact, monkeypatch):
    """A shape whose split sums differently (as MKL's self-threaded calls do) keeps F.linear."""
    off = types.SimpleNamespace(decode_linear=lambda x, w, b: F.linear(x, w, b) + 1e-3)
    monkeypatch.setattr(decode_linear, "load", lambda: off)
    monkeypatch.setattr(decode_linear, "_EXACT", {})
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    assert torch.equal(decode_linear.linear(x, w), F.linear(x, w))
    assert decode_linear._EXACT == {(3, 64, 32, torch.float32, False, torch.get_num_threads()): False}


def test_linear_keeps_leading_dims_and_threads(native, exact):
    w, x = torch.randn(300, 64), torch.randn(2, 3, 64)
    assert decode_linear.applies(x, w)
    assert torch.equal(decode_linear.linear(x, w), F.linear(x, w))
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # nothing to split over: torch's own call
        assert not decode_linear.applies(x, w)
    finally:
        torch.set_num_threads(prev)


def test_rule_falls_back_to_f_linear(native):
    w = torch.randn(64, 32)
    assert not decode_linear.applies(torch.randn(decode_linear.MAX_ROWS + 1, 32), w)  # MKL threads these itself
    assert not decode_linear.applies(torch.randn(0, 32), w)
    assert not decode_linear.applies(torch.randn(2, 32, dtype=torch.float64), w)
    assert not decode_linear.applies(torch.randn(2, 64), torch.randn(32, 64).t())  # non-contiguous weight
    x = torch.randn(decode_linear.MAX_ROWS + 1, 32)
    assert torch.equal(decode_linear.linear(x, w), F.linear(x, w))


def test_linear_hook_splits_plain_layers_only(native, exact):
    calls = []

    def original(self, layer, x, bias=None):
        calls.append(layer)
        return F.linear(x, layer.weight, bias)

    layer = types.SimpleNamespace(weight=torch.randn(96, 32))
    x = torch.randn(2, 32)
    assert torch.equal(hooks.linear_apply(original, None, layer, x), F.linear(x, layer.weight))
    assert calls == []  # the split ran
    amx = types.SimpleNamespace(weight=layer.weight, use_intel_amx_backend=True)
    hooks.linear_apply(original, None, amx, x)
    hooks.linear_apply(original, None, layer, torch.randn(decode_linear.MAX_ROWS + 1, 32))
    assert calls == [amx, layer]  # AMX's packed weights and long prefills: SGLang's code


def test_lm_head_hook_keeps_sglang_branches(native, exact):
    calls = []

    def original(self, hidden, lm_head, embedding_bias=None, **kw):
        calls.append(lm_head)
        return hidden @ lm_head.weight.T

    proc = types.SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    head = types.SimpleNamespace(weight=torch.randn(500, 64), quant_method=None)
    h = torch.randn(3, 64)
    assert torch.equal(hooks.compute_lm_head(original, proc, h, head), h @ head.weight.T)
    assert calls == []
    lora = types.SimpleNamespace(weight=head.weight, quant_method=None, set_lora=None)
    hooks.compute_lm_head(original, proc, h, lora)
    fp32 = types.SimpleNamespace(use_fp32_lm_head=True, rl_on_policy_target=None)
    hooks.compute_lm_head(original, fp32, h, head)
    assert calls == [lora, head]
