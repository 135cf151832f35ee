"""The kv_load kernel (a restored layer into the CPU pool): bitwise what the torch path writes, for
float32 and bfloat16 pools, rows in the pool's dtype (any slot order, runs of consecutive slots and
strided sources) and int8 rows with their scales; bad arguments are refused, not written out of bounds."""

from __future__ import annotations

import pytest
import torch

from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.kernels import kv_load

H, D = 3, 64
native = kv_load.load()
pytestmark = pytest.mark.skipif(native is None, reason="no compiler for the kv_load kernel here")


POOL_DTYPES = [torch.float32, torch.bfloat16]


def pools(n: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n, H, D), float("nan"), dtype=dtype), torch.full((n, H, D), float("nan"), dtype=dtype)


def torch_path(q: QuantKV, layer: int, dtype) -> torch.Tensor:
    """What the loader's torch path writes for an int8 layer: the product, cast to the pool's dtype."""
    return torch.mul(q.q[layer], q.scale[layer].unsqueeze(-1)).to(dtype)


@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("order", ["consecutive", "pages", "random"])
def test_rows_in_the_pools_dtype_land_bit_for_bit(order, dtype):
    g = torch.Generator().manual_seed(0)
    T = 200
    kv = torch.randn(4, 2, T + 30, H, D, generator=g).to(dtype)[:, :, 30:]  # a token slice: strided like a tier's
    if order == "consecutive":
        slots = torch.arange(17, 17 + T)
    elif order == "pages":  # pages of 16 in shuffled order (what the paged allocator hands out)
        pages = torch.randperm(T // 16 + 1, generator=g)
        slots = (pages[:, None] * 16 + torch.arange(16)).flatten()[:T]
    else:
        slots = torch.randperm(400, generator=g)[:T]
    k, v = pools(400, dtype)
    native.load_layer(kv[2, 0], kv[2, 1], None, None, slots, k, v)
    rk, rv = pools(400, dtype)
    rk.index_copy_(0, slots, kv[2, 0])
    rv.index_copy_(0, slots, kv[2, 1])
    assert torch.equal(k.nan_to_num(7.0), rk.nan_to_num(7.0)) and torch.equal(v.nan_to_num(7.0), rv.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
def test_int8_rows_decode_to_torch_mul(dtype):
    g = torch.Generator().manual_seed(1)
    q = QuantKV.quantize(torch.randn(3, 2, 90, H, D, generator=g) * 5).slice_tokens(10, 90)
    slots = torch.randperm(300, generator=g)[:80]
    k, v = pools(300, dtype)
    native.load_layer(q.q[1, 0], q.q[1, 1], q.scale[1, 0], q.scale[1, 1], slots, k, v)
    want = torch_path(q, 1, dtype)
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
    with pytest.raises(RuntimeError, match="float32 or bfloat16 pool"):
        native.load_layer(src, src, None, None, torch.arange(4), k.to(torch.float16), v.to(torch.float16))
    bk, bv = pools(32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="pool's dtype"):  # float32 rows into a bfloat16 pool: not cast here
        native.load_layer(src, src, None, None, torch.arange(4), bk, bv)
    with pytest.raises(RuntimeError, match="pool's dtype"):
        native.load_layers([src], [src], [], [], [torch.arange(4)], [bk], [bv])
    assert torch.isnan(k).all() and torch.isnan(bk).all()
    assert (
        not kv_load.fits(src, bk) and kv_load.fits(src.to(torch.bfloat16), bk) and kv_load.fits(src.to(torch.int8), bk)
    )


def test_bfloat16_rounding_is_torchs_at_ties_and_subnormals():
    # products whose float32 bits sit exactly halfway between two bfloat16 values (ties to even, both
    # ways), just either side of halfway, and subnormal (the hardware conversion would flush them)
    halves = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00008000, 0x00018000, 0x00000001],
                          dtype=torch.int32).view(torch.float32)  # fmt: skip
    n = 16 * H * D // len(halves) + 1
    scale = halves.repeat(n)[: 16 * H].view(16, H)
    q = QuantKV(torch.ones(1, 2, 16, H, D, dtype=torch.int8), scale.expand(1, 2, 16, H).contiguous())
    k, v = pools(16, torch.bfloat16)
    native.load_layer(q.q[0, 0], q.q[0, 1], q.scale[0, 0], q.scale[0, 1], torch.arange(16), k, v)
    want = torch_path(q, 0, torch.bfloat16)
    assert torch.equal(k.view(torch.int16), want[0].view(torch.int16)) and torch.equal(v, want[1])
    assert want[0].view(torch.int16).unique().numel() >= 5  # the cases do round to different values


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


def _pool_at(n: int, offset: int, dtype=torch.float32) -> torch.Tensor:
    """A contiguous [n, H, D] pool buffer whose data starts ``offset`` elements past a 64-byte boundary."""
    per_line = 64 // dtype.itemsize
    flat = torch.full((n * H * D + per_line,), float("nan"), dtype=dtype)
    start = (-flat.data_ptr() // dtype.itemsize) % per_line + offset
    return flat[start : start + n * H * D].view(n, H, D)


@pytest.mark.parametrize("pool", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", ["pool", "int8"])
def test_a_load_past_the_streaming_size_lands_bit_for_bit(dtype, offset, pool):
    # a few MB per call: the kernel's streamed (non-temporal) stores, aligned or not, write what
    # torch writes, and nothing else
    g = torch.Generator().manual_seed(4)
    L, T, S = 3, 2048, 4096
    kv = (torch.randn(L, 2, T, H, D, generator=g) * 3).to(pool)
    q = QuantKV.quantize(kv.float()) if dtype == "int8" else None
    pages = torch.randperm(S // 16, generator=g)[: T // 16]
    slots = (pages[:, None] * 16 + torch.arange(16)).flatten()
    k = [_pool_at(S, offset, pool) for _ in range(L)]
    v = [_pool_at(S, offset, pool) for _ in range(L)]
    if q is None:
        native.load_layers([kv[i, 0] for i in range(L)], [kv[i, 1] for i in range(L)], [], [], [slots] * L, k, v)
        want = kv
    else:
        native.load_layers([q.q[i, 0] for i in range(L)], [q.q[i, 1] for i in range(L)],
                           [q.scale[i, 0] for i in range(L)], [q.scale[i, 1] for i in range(L)], [slots] * L, k, v)  # fmt: skip
        want = torch.stack([torch_path(q, i, pool) for i in range(L)])
    others = torch.ones(S, dtype=torch.bool)
    others[slots] = False
    for i in range(L):
        assert torch.equal(k[i][slots], want[i, 0]) and torch.equal(v[i][slots], want[i, 1])
        assert torch.isnan(k[i][others]).all() and torch.isnan(v[i][others]).all()
    one_k, one_v = _pool_at(S, offset, pool), _pool_at(S, offset, pool)  # one layer on its own (streamed for float32)
    src = (kv[0, 0], kv[0, 1], None, None) if q is None else (q.q[0, 0], q.q[0, 1], q.scale[0, 0], q.scale[0, 1])
    native.load_layer(*src, slots, one_k, one_v)
    assert torch.equal(one_k[slots], want[0, 0]) and torch.equal(one_v[slots], want[0, 1])


@pytest.mark.parametrize("pool", POOL_DTYPES, ids=str)
def test_a_synchronous_resume_of_uneven_parts_lands_as_the_torch_path(pool):
    """What a CPU resume submits: a long history, a short last turn, a part with a recomputed front
    (per layer) and one in the pool's dtype beside int8 ones; the work is split by rows (not by
    layer: a long part's layers all on one thread was half the speed) and every row lands as the
    torch path writes it, nothing else written."""
    from sgl_loopkv.cache.loader import LayerwiseLoader, LoadPart

    g = torch.Generator().manual_seed(5)
    L, S = 4, 4096
    sizes = [1300, 16, 48, 64]
    q = [QuantKV.quantize(torch.randn(L, 2, n, H, D, generator=g) * 2) for n in sizes[:3]]
    plain = (torch.randn(L, 2, sizes[3], H, D, generator=g)).to(pool)
    order = torch.randperm(S, generator=g)
    firsts = torch.tensor([0, *sizes]).cumsum(0)
    slots = [order[firsts[i] : firsts[i + 1]] for i in range(len(sizes))]
    skip = (0, 16, 32, 48)  # layer l of the third part: its first skip[l] rows recomputed, not loaded
    k, v = zip(*[pools(S, pool) for _ in range(L)])
    loader = LayerwiseLoader(list(k), list(v), synchronous=True)
    parts = [
        LoadPart(q[0], slots[0]),
        LoadPart(q[1], slots[1]),
        LoadPart(q[2], slots[2], skip),
        LoadPart(plain, slots[3]),
    ]
    loader.submit(parts)
    assert not loader.pending
    written = torch.zeros(S, dtype=torch.bool)
    for layer in range(L):
        for i in range(len(parts)):
            s = skip[layer] if i == 2 else 0
            want = plain[layer] if i == 3 else torch_path(q[i], layer, pool)
            at = slots[i][s:]
            assert torch.equal(k[layer][at], want[0, s:]) and torch.equal(v[layer][at], want[1, s:])
            written[at] = True
        assert torch.isnan(k[layer][~written]).all() and torch.isnan(v[layer][~written]).all()
        written[:] = False
