"""Prefills in bfloat16 on the GGUF path (``sgl_loopkv.models.precision``, ``--loopkv-prefill-dtype``):
``auto`` follows the CPU's AMX-BF16 flag; in bfloat16 mode a GEMM of 17 rows or more multiplies x and the
dequantized tile rounded to bfloat16 (within bfloat16 rounding of a float64 product, bias added in float32)
and a dense extend over a bfloat16 pool rounds its queries; 16 rows or fewer (decode steps, short extends)
keep the float32 bits whatever the mode."""

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


def test_auto_follows_the_cpus_amx_bf16_flag(mode, monkeypatch):
    mode("auto", {"avx512f", "amx_bf16", "amx_tile"})
    assert precision.prefill_bf16() and precision.bf16_rows(precision.MIN_ROWS)
    assert not precision.bf16_rows(precision.MIN_ROWS - 1)  # a decode step or short extend: float32
    mode("auto", {"avx512f", "avx512_bf16"})  # bf16 dot products without AMX: not measured to pay
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


def test_a_long_extend_over_a_bf16_pool_rounds_its_queries(mode):
    g = torch.Generator().manual_seed(5)
    n, cached = precision.MIN_ROWS + 47, 100
    q = torch.randn(n, 9, 64, generator=g)
    k = torch.randn(cached + n, 3, 64, generator=g).bfloat16()
    v = torch.randn(cached + n, 3, 64, generator=g).bfloat16()
    mode("float32")
    fp32 = dense_attention(q, k, v, 0.125)
    assert fp32.dtype == torch.float32
    mode("bfloat16")
    bf16 = dense_attention(q, k, v, 0.125)
    assert bf16.dtype == torch.float32
    assert torch.equal(bf16, dense_attention(q.bfloat16(), k, v, 0.125).float())
    assert not torch.equal(bf16, fp32) and (bf16 - fp32).abs().max() < 0.05
    short = q[: precision.MIN_ROWS - 1]  # keys: the cached part and the short extend's own rows
    ks, vs = k[: cached + short.shape[0]], v[: cached + short.shape[0]]
    assert torch.equal(dense_attention(short, ks, vs, 0.125), fp32_of(short, ks, vs, mode))
    mode("bfloat16")
    assert torch.equal(dense_attention(q, k.float(), v.float(), 0.125), fp32_of(q, k.float(), v.float(), mode))


def fp32_of(q, k, v, mode) -> torch.Tensor:
    """``dense_attention`` in float32 mode, then back to bfloat16 mode."""
    mode("float32")
    out = dense_attention(q, k, v, 0.125)
    mode("bfloat16")
    return out
