"""The kv_quant kernels (a finished turn into its stored form): bitwise what the torch code computes,
for float32 and bfloat16 turns, including the values where a rounding could differ (halves, zero rows,
tiny and huge magnitudes), strided keys and partial chunks; and a stored turn's store no longer waits
on torch's passes (timed against the torch code in the same process)."""

from __future__ import annotations

import time

import pytest
import torch

from sgl_loopkv.cache.quant import QMAX, QuantKV, quantize_torch
from sgl_loopkv.kernels import kv_quant
from sgl_loopkv.selection.pages import chunk_minmax, chunk_minmax_torch

native = kv_quant.load()
pytestmark = pytest.mark.skipif(native is None, reason="no compiler for the kv_quant kernel here")
DTYPES = [torch.float32, torch.bfloat16]


def turn(dtype, T=200, H=3, D=64, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, T, H, D, generator=g) * torch.logspace(-30, 30, 4)[:, None, None, None, None]
    if T > 7 and D > 4:
        kv[0, 0, 3] = 0.0  # a zero row: scale 0, every q 0
        kv[1, 1, 5, 0, :4] = torch.tensor([1.0, -0.5, 0.5, 1.5])  # exact halves of the scale
        kv[1, 1, 5, 0, 4:] = 0.0
        kv[1, 1, 5, 0, 4] = 127.0  # the row's max: scale 1, so the halves round to even
        kv[2, 0, 7, 1] = torch.finfo(torch.float32).tiny / 4  # a subnormal row
    return kv.to(dtype).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_matches_torch_bit_for_bit(dtype):
    kv = turn(dtype)
    q, scale = native.quantize(kv)
    q_ref, scale_ref = quantize_torch(kv)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref), (q != q_ref).nonzero()[:5]
    assert q.abs().max() <= QMAX and torch.equal(q[1, 1, 5, 0, :5], torch.tensor([1, 0, 0, 2, 127], dtype=torch.int8))


@pytest.mark.parametrize("D", [64, 24, 7])  # the vector body, a tail, a row shorter than one vector
def test_quantize_any_row_length(D):
    kv = turn(torch.float32, T=33, D=D)
    q, scale = native.quantize(kv)
    q_ref, scale_ref = quantize_torch(kv)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantkv_takes_the_kernel_only_where_it_applies():
    kv = turn(torch.bfloat16)
    assert kv_quant.takes(kv) and not kv_quant.takes(kv[:, :, 1:]) and not kv_quant.takes(kv.half())
    for x in (kv, kv[:, :, 1:], kv.half()):  # native, strided (torch), float16 (torch): one answer
        got, (q_ref, scale_ref) = QuantKV.quantize(x), quantize_torch(x)
        assert torch.equal(got.q, q_ref) and torch.equal(got.scale, scale_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [16 * 12, 16 * 12 + 5, 3])  # whole chunks, a partial last chunk, only a partial
def test_chunk_minmax_matches_torch(dtype, T):
    kv = turn(dtype, T=T)
    k = kv[:, 0]  # strided like a stored turn's keys
    assert kv_quant.chunk_rows(k) is not None
    got = chunk_minmax(k, 16)
    assert got.shape == (4, -(-T // 16), 3, 2, 64)
    assert torch.equal(got, chunk_minmax_torch(k, 16))
    assert torch.equal(chunk_minmax(k[0], 16), chunk_minmax_torch(k[0], 16))  # no lead dims


def test_chunk_minmax_falls_back_where_the_kernel_does_not_apply():
    k = turn(torch.float32)[:, 0]
    for x in (k.transpose(-1, -2), k.half(), k[:, :0]):  # a [H, D] that is not contiguous; float16; no tokens
        assert torch.equal(chunk_minmax(x, 16), chunk_minmax_torch(x, 16))


def test_a_long_turns_store_is_one_pass():
    """A 4K-token turn of the default model's shape on one thread: the kernels take a fraction of
    torch's passes (which cost ~0.4 s for a 5K-token turn and held the scheduler)."""
    kv = torch.randn(30, 2, 4096, 3, 64).bfloat16()

    def best(f) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = best(lambda: (native.quantize(kv), native.chunk_minmax(kv[:, 0], 16)))
        theirs = best(lambda: (quantize_torch(kv), chunk_minmax_torch(kv[:, 0], 16)))
    finally:
        torch.set_num_threads(threads)
    assert ours * 4 < theirs, (ours, theirs)
