"""The kv_load kernel (a restored layer into the CPU pool): bitwise what the torch path writes, for
float32 rows (any slot order, runs of consecutive slots and strided sources) and int8 rows with
their scales; bad arguments are refused, not written out of bounds."""

from __future__ import annotations

import pytest
import torch

from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.kernels import kv_load

H, D = 3, 64
native = kv_load.load()
pytestmark = pytest.mark.skipif(native is None, reason="no compiler for the kv_load kernel here")


def pools(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n, H, D), float("nan")), torch.full((n, H, D), float("nan"))


@pytest.mark.parametrize("order", ["consecutive", "pages", "random"])
def test_float_rows_land_bit_for_bit(order):
    g = torch.Generator().manual_seed(0)
    T = 200
    kv = torch.randn(4, 2, T + 30, H, D, generator=g)[:, :, 30:]  # a token slice: strided like a tier's
    if order == "consecutive":
        slots = torch.arange(17, 17 + T)
    elif order == "pages":  # pages of 16 in shuffled order (what the paged allocator hands out)
        pages = torch.randperm(T // 16 + 1, generator=g)
        slots = (pages[:, None] * 16 + torch.arange(16)).flatten()[:T]
    else:
        slots = torch.randperm(400, generator=g)[:T]
    k, v = pools(400)
    native.load_layer(kv[2, 0], kv[2, 1], None, None, slots, k, v)
    rk, rv = pools(400)
    rk.index_copy_(0, slots, kv[2, 0])
    rv.index_copy_(0, slots, kv[2, 1])
    assert torch.equal(k.nan_to_num(7.0), rk.nan_to_num(7.0)) and torch.equal(v.nan_to_num(7.0), rv.nan_to_num(7.0))


def test_int8_rows_decode_to_torch_mul():
    g = torch.Generator().manual_seed(1)
    q = QuantKV.quantize(torch.randn(3, 2, 90, H, D, generator=g) * 5).slice_tokens(10, 90)
    slots = torch.randperm(300, generator=g)[:80]
    k, v = pools(300)
    native.load_layer(q.q[1, 0], q.q[1, 1], q.scale[1, 0], q.scale[1, 1], slots, k, v)
    want = torch.mul(q.q[1], q.scale[1].unsqueeze(-1))
    assert torch.equal(k[slots], want[0]) and torch.equal(v[slots], want[1])
    others = torch.ones(300, dtype=torch.bool)
    others[slots] = False
    assert torch.isnan(k[others]).all()  # nothing else written


def test_bad_arguments_are_refused():
    k, v = pools(32)
    src = torch.randn(4, H, D)
    with pytest.raises(RuntimeError, match="out of range"):
        native.load_layer(src, src, None, None, torch.tensor([0, 1, 2, 32]), k, v)
    with pytest.raises(RuntimeError, match="scales"):
        native.load_layer(src.to(torch.int8), src.to(torch.int8), None, None, torch.arange(4), k, v)
    with pytest.raises(RuntimeError, match="float32 pool"):
        native.load_layer(src, src, None, None, torch.arange(4), k.to(torch.bfloat16), v.to(torch.bfloat16))
    assert torch.isnan(k).all()


def test_all_layers_at_once_equal_one_layer_at_a_time():
    g = torch.Generator().manual_seed(3)
    L = 5
    q = QuantKV.quantize(torch.randn(L, 2, 70, H, D, generator=g))
    slots = [torch.randperm(200, generator=g)[: 70 - 7 * i] for i in range(L)]
    one_k, one_v = zip(*[pools(200) for _ in range(L)])
    all_k, all_v = zip(*[pools(200) for _ in range(L)])
    for i in range(L):
        s = 7 * i
        native.load_layer(
            q.q[i, 0, s:], q.q[i, 1, s:], q.scale[i, 0, s:], q.scale[i, 1, s:], slots[i], one_k[i], one_v[i]
        )
    native.load_layers(
        [q.q[i, 0, 7 * i :] for i in range(L)], [q.q[i, 1, 7 * i :] for i in range(L)],
        [q.scale[i, 0, 7 * i :] for i in range(L)], [q.scale[i, 1, 7 * i :] for i in range(L)],
        slots, list(all_k), list(all_v),
    )  # fmt: skip
    for a, b in zip((*one_k, *one_v), (*all_k, *all_v)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    with pytest.raises(RuntimeError, match="out of range"):  # checked before any layer is written
        native.load_layers([q.q[0, 0]], [q.q[0, 1]], [q.scale[0, 0]], [q.scale[0, 1]], [torch.arange(70) + 200],
                           [all_k[0]], [all_v[0]])  # fmt: skip


def _pool_at(n: int, offset_floats: int) -> torch.Tensor:
    """A contiguous [n, H, D] pool buffer whose data starts ``offset_floats`` past a 64-byte boundary."""
    flat = torch.full((n * H * D + 16,), float("nan"))
    start = (-flat.data_ptr() // 4) % 16 + offset_floats
    return flat[start : start + n * H * D].view(n, H, D)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_load_past_the_streaming_size_lands_bit_for_bit(dtype, offset):
    # a few MB per call: the kernel's streamed (non-temporal) stores, aligned or not, write what
    # torch writes, and nothing else
    g = torch.Generator().manual_seed(4)
    L, T, S = 3, 2048, 4096
    kv = torch.randn(L, 2, T, H, D, generator=g) * 3
    q = QuantKV.quantize(kv) if dtype == "int8" else None
    pages = torch.randperm(S // 16, generator=g)[: T // 16]
    slots = (pages[:, None] * 16 + torch.arange(16)).flatten()
    k = [_pool_at(S, offset) for _ in range(L)]
    v = [_pool_at(S, offset) for _ in range(L)]
    if q is None:
        native.load_layers([kv[i, 0] for i in range(L)], [kv[i, 1] for i in range(L)], [], [], [slots] * L, k, v)
        want = kv
    else:
        native.load_layers([q.q[i, 0] for i in range(L)], [q.q[i, 1] for i in range(L)],
                           [q.scale[i, 0] for i in range(L)], [q.scale[i, 1] for i in range(L)], [slots] * L, k, v)  # fmt: skip
        want = torch.stack([q[i] for i in range(L)])
    others = torch.ones(S, dtype=torch.bool)
    others[slots] = False
    for i in range(L):
        assert torch.equal(k[i][slots], want[i, 0]) and torch.equal(v[i][slots], want[i, 1])
        assert torch.isnan(k[i][others]).all() and torch.isnan(v[i][others]).all()
    one_k, one_v = _pool_at(S, offset), _pool_at(S, offset)  # one layer on its own streams too (3 MB)
    src = (kv[0, 0], kv[0, 1], None, None) if q is None else (q.q[0, 0], q.q[0, 1], q.scale[0, 0], q.scale[0, 1])
    native.load_layer(*src, slots, one_k, one_v)
    assert torch.equal(one_k[slots], want[0, 0]) and torch.equal(one_v[slots], want[0, 1])
