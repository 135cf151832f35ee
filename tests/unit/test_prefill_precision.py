"""Prefills in bfloat16 on the GGUF path (``sgl_loopkv.models.precision``, ``--loopkv-prefill-dtype``):
``auto`` follows the CPU's AMX-BF16 and AVX512-BF16 flags; in bfloat16 mode a GEMM of 17 rows or more multiplies x and the
dequantized weight rounded to bfloat16: ``gemm_bf16`` (oneDNN, a weight of a multiple of 64 rows) keeps
float32 sums and results (within float32 rounding of a float64 product of the rounded operands), other
weights go through torch's bfloat16 GEMM (within one bfloat16 rounding), the bias added in float32; attention
never rounds its queries to bfloat16; 16 rows or fewer (decode steps, short extends) keep the
float32 bits whatever the mode."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sgl_loopkv.attention.executor import dense_attention
from sgl_loopkv.kernels import gguf_linear
from sgl_loopkv.models import precision
from sgl_loopkv.models.gguf.reader import BlockWeight
from tests.unit.test_gguf_kernels import random_blocks

linear_module = importlib.import_module("sgl_loopkv.models.gguf.linear")  # the package exports linear(), the function


@pytest.fixture
def mode(monkeypatch):
    """Sets this process's prefill dtype (as the plugin does); restores float32 after the test."""

    def set_mode(value: str, flags: set[str] | None = None):
        if flags is not None:
            monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
        precision.use(value)

    monkeypatch.delenv(precision.ENV, raising=False)
    yield set_mode
    precision.use("float32")


@pytest.fixture(scope="module")
def native():
    module = gguf_linear.load()
    if module is None:
        pytest.skip("no C++ toolchain: the GGUF kernels are unavailable")
    return module


def weight(rows: int = 70, k: int = 544) -> BlockWeight:
    blocks = random_blocks(T.Q4_1, rows, k, np.random.default_rng(7))
    return BlockWeight("w", T.Q4_1, (rows, k), torch.from_numpy(np.ascontiguousarray(blocks)))


def test_auto_follows_the_cpus_bf16_flags(mode, monkeypatch):
    mode("auto", {"avx512f", "amx_bf16", "amx_tile"})
    assert precision.prefill_bf16() and precision.bf16_rows(precision.MIN_ROWS)
    assert not precision.bf16_rows(precision.MIN_ROWS - 1)  # a decode step or short extend: float32
    mode("auto", {"avx512f", "avx512_bf16"})  # bf16 dot products without AMX (an AMD EPYC): about 2x float32
    assert precision.prefill_bf16()
    mode("auto", {"avx2", "fma", "avx512f"})  # bfloat16 emulated: slower than float32
    assert not precision.prefill_bf16()
    mode("bfloat16", set())
    assert precision.prefill_bf16()
    mode("float32", {"amx_bf16"})
    assert not precision.prefill_bf16()
    monkeypatch.setenv(precision.ENV, "bfloat16")  # the process override wins over the server's choice
    precision.prefill_bf16.cache_clear()
    assert precision.prefill_bf16()
    monkeypatch.setenv(precision.ENV, "fp8")
    precision.prefill_bf16.cache_clear()
    with pytest.raises(ValueError, match=precision.ENV):
        precision.prefill_bf16()
    with pytest.raises(ValueError, match="expected one of"):
        precision.use("half")


def test_softmax_weights_split_unless_rounded_once(mode, monkeypatch):
    monkeypatch.delenv(precision.SOFTMAX_ENV, raising=False)
    mode("bfloat16")
    assert precision.split_softmax()  # the default: two bfloat16 parts
    precision.use("bfloat16", "bfloat16")
    assert not precision.split_softmax()
    monkeypatch.setenv(precision.SOFTMAX_ENV, "split")  # the process override wins
    precision.split_softmax.cache_clear()
    assert precision.split_softmax()
    monkeypatch.setenv(precision.SOFTMAX_ENV, "half")
    precision.split_softmax.cache_clear()
    with pytest.raises(ValueError, match=precision.SOFTMAX_ENV):
        precision.split_softmax()
    monkeypatch.delenv(precision.SOFTMAX_ENV)
    with pytest.raises(ValueError, match="prefill softmax"):
        precision.use("bfloat16", "float16")


def test_bf16_gemm_is_the_rounded_operands_product(native, mode):
    w = weight()
    deq = native.dequantize(w.blocks, int(T.Q4_1), w.in_features, -1)
    x = torch.randn(precision.MIN_ROWS + 23, w.in_features, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(w.out_features, generator=torch.Generator().manual_seed(4))
    y = native.gemm_dequant(x, w.blocks, int(T.Q4_1), bias, 32, True)  # several tiles, the last one short
    ref = (x.bfloat16().double() @ deq.bfloat16().double().T) + bias.double()
    exact = x.double() @ deq.double().T + bias.double()
    # float32 sums of exact bfloat16 products, then one rounding to bfloat16 before the bias
    bound = 2.0**-8 * (x.bfloat16().double().abs() @ deq.bfloat16().double().abs().T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    assert not torch.equal(y, native.gemm_dequant(x, w.blocks, int(T.Q4_1), bias, 32, False))  # really bf16
    assert (y.double() - exact).abs().max() < 0.1 * exact.abs().max()  # and still the product

    mode("bfloat16")
    assert torch.equal(linear_module.linear(x, w, bias), y.to(x.dtype))
    few = x[: precision.MIN_ROWS - 1]  # gemv rows: the float32 kernel, bit for bit
    assert torch.equal(linear_module.linear(few, w, bias), native.gemv(few, w.blocks, int(T.Q4_1), bias, -1))
    mode("float32")
    assert torch.equal(
        linear_module.linear(x, w, bias), native.gemm_dequant(x, w.blocks, int(T.Q4_1), bias, 512, False)
    )


def test_oneDNN_bf16_gemm_keeps_float32_sums(native, mode):
    if not native.gemm_bf16_fits(128, 544):
        pytest.skip("no bfloat16 brgemm on this CPU (AMX-BF16 or AVX512-BF16)")
    w = weight(rows=128)
    deq = native.dequantize(w.blocks, int(T.Q4_1), w.in_features, -1)
    x = torch.randn(precision.MIN_ROWS + 100, w.in_features, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(w.out_features, generator=torch.Generator().manual_seed(8))
    y = native.gemm_bf16(x, w.blocks, int(T.Q4_1), bias)
    ref = (x.bfloat16().double() @ deq.bfloat16().double().T) + bias.double()
    mags = x.bfloat16().double().abs() @ deq.bfloat16().double().abs().T + bias.double().abs()
    assert ((y.double() - ref).abs() <= w.in_features * 2.0**-23 * mags).all()  # float32 sums, no bf16 result
    tiles = native.gemm_dequant(x, w.blocks, int(T.Q4_1), bias, 512, True)  # torch's bf16 GEMM: rounded result
    assert (tiles.double() - ref).abs().max() > 10 * (y.double() - ref).abs().max()
    mode("bfloat16")
    assert torch.equal(linear_module.linear(x, w, bias), y)
    assert not native.gemm_bf16_fits(70, 544)  # rows not a multiple of 64: the torch path (test above)
    with pytest.raises(RuntimeError, match="N % 64"):
        native.gemm_bf16(x, weight().blocks, int(T.Q4_1), None)


@pytest.mark.parametrize("softmax", ["split", "bfloat16"])
def test_attention_never_rounds_its_queries(mode, softmax):
    """Queries rounded to bfloat16 cost the prefill path its fidelity bar. In float32 mode a long extend over
    the bfloat16 pool is torch's float32 kernel over the widened keys; in bfloat16 mode, where the CPU has
    AMX-BF16 or AVX512-BF16, the split-bfloat16 kernel (queries in two bfloat16 parts; with split softmax
    weights within 2^-12 of float32's result, with weights rounded once within 2^-9 more,
    tests/unit/test_prefill_attention.py), never a bfloat16 query."""
    from sgl_loopkv.attention import executor

    g = torch.Generator().manual_seed(5)
    n, cached = precision.MIN_ROWS + 47, 100
    q = torch.randn(n, 9, 64, generator=g)
    k = torch.randn(cached + n, 3, 64, generator=g).bfloat16()
    v = torch.randn(cached + n, 3, 64, generator=g).bfloat16()
    widened = dense_attention(q, k.float(), v.float(), 0.125)  # a float32 pool: torch's kernel in any mode
    mode("float32")
    assert torch.equal(dense_attention(q, k, v, 0.125), widened)
    mode("bfloat16")
    precision.use("bfloat16", softmax)
    split = softmax == "split"
    ours = dense_attention(q, k, v, 0.125)
    kernel = executor.prefill_kernel()
    assert torch.equal(ours, widened if kernel is None else kernel.flash_split(q, k, v, 0.125, split))
    assert (ours - widened).abs().max() <= (2.0**-12 if split else 2.0**-12 + 2.0**-9) * v.float().abs().max()
    rounded = dense_attention(q.bfloat16(), k, v, 0.125).float()
    assert (ours - widened).abs().max() < (rounded - widened).abs().max() / (8 if split else 2)
