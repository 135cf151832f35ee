"""Sparse decode executors (sgl_loopkv/attention/decode_gpu.py): the torch reference on CPU against
dense attention and a list-by-list float64 loop; on a CUDA GPU the Triton kernel (fp32, bf16,
fp16; splits; strided views) and FlashInfer's paged decode against the reference in float64.
Outputs are poisoned with NaN first, so an unwritten row fails. The Triton kernel on CPU:
tests/e2e/test_triton_interpreter.py."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from sgl_loopkv.attention import dense_attention
from sgl_loopkv.attention.decode_gpu import sparse_decode_reference


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# ||out - ref|| / ||ref||: fp32 accumulation throughout; half types round the output (FlashInfer also p)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}


def random_lists(g: torch.Generator, lens: list[int], pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """head_indptr, head_slots: per list ``n`` distinct random slots of ``pool``, ascending."""
    slots = [torch.randperm(pool, generator=g)[:n].sort().values for n in lens]
    return torch.tensor([0, *lens]).cumsum(0), torch.cat(slots)


def random_case(g, B: int, H: int, G: int, D: int, lens: list[int], pool: int = 0):
    """q [B, H * G, D], pool [P, H, D] (float32, CPU) and lists of the given lengths (B * H of them)."""
    assert len(lens) == B * H
    pool = pool or max(lens) + 37
    q = torch.randn(B, H * G, D, generator=g)
    k, v = torch.randn(pool, H, D, generator=g), torch.randn(pool, H, D, generator=g)
    return q, k, v, *random_lists(g, lens, pool)


def loop_reference(q, k, v, indptr, slots, scale) -> torch.Tensor:
    """The contract list by list, float64."""
    B, Hq, D = q.shape
    H = k.shape[1]
    G = Hq // H
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            sl = slots[indptr[b * H + h] : indptr[b * H + h + 1]]
            s = q[b, h * G : (h + 1) * G].double() @ k[sl, h].double().T * scale
            out[b, h * G : (h + 1) * G] = s.softmax(-1) @ v[sl, h].double()
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_reference_equals_dense_attention_when_every_head_lists_all_slots():
    """Every head of a sequence lists all its slots (in a shuffled pool): dense softmax attention."""
    g = torch.Generator().manual_seed(0)
    H, G, D, lens = 3, 3, 32, [40, 1, 130]
    perm = torch.randperm(sum(lens) + 50, generator=g)
    k, v = torch.randn(len(perm), H, D, generator=g), torch.randn(len(perm), H, D, generator=g)
    q = torch.randn(len(lens), H * G, D, generator=g)
    seq_slots = perm[: sum(lens)].split(lens)
    indptr = torch.tensor([0] + [n for n in lens for _ in range(H)]).cumsum(0)
    slots = torch.cat([s for s in seq_slots for _ in range(H)])
    out = sparse_decode_reference(q, k, v, indptr, slots, 0.2, torch.full_like(q, math.nan))
    for b, sl in enumerate(seq_slots):
        dense = dense_attention(q[b : b + 1], k[sl], v[sl], 0.2, causal=False)
        torch.testing.assert_close(out[b : b + 1], dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("G", [1, 3])
def test_reference_equals_list_by_list_loop(G):
    """Lists of different lengths (1, not block multiples, one empty: zeros) per head and sequence."""
    g = torch.Generator().manual_seed(G)
    lens = [1, 17, 64, 65, 0, 200]
    q, k, v, indptr, slots = random_case(g, 3, 2, G, 16, lens)
    out = sparse_decode_reference(q, k, v, indptr, slots, 0.3, torch.full_like(q, math.nan))
    torch.testing.assert_close(out.double(), loop_reference(q, k, v, indptr, slots, 0.3), rtol=1e-5, atol=1e-6)
    assert not out[2, :G].any()  # the empty list (sequence 2, head 0)


def test_default_num_splits():
    from sgl_loopkv.kernels.sparse_decode_triton import MIN_KEYS_PER_SPLIT, default_num_splits

    assert default_num_splits(3, 3 * 8192, 264) == 64  # one long sequence: 128-key splits
    assert default_num_splits(24, 24 * 2048, 264) == 11
    assert default_num_splits(3, 3 * 300, 264) == 300 // MIN_KEYS_PER_SPLIT  # short lists: few splits
    assert default_num_splits(3, 3 * 50, 264) == 1
    assert default_num_splits(1000, 1000 * 8192, 264) == 1  # a large batch fills it already


def test_pool_pages_are_slot_times_heads_plus_head():
    from sgl_loopkv.attention.decode_gpu import pool_pages

    g = torch.Generator().manual_seed(6)
    indptr, slots = random_lists(g, [3, 1, 0, 40, 7, 2], 100)
    pages = pool_pages(indptr, slots, 3)
    want = [int(slots[j]) * 3 + r % 3 for r in range(6) for j in range(indptr[r], indptr[r + 1])]
    assert pages.dtype == torch.int32 and pages.tolist() == want


class FakeDecodeWrapper:
    """FlashInfer's decode wrapper in torch (what FlashInferSparseDecode relies on: one request per
    indptr row over pages of [num_pages, page_size, num_kv_heads, D]), checking the plan arguments."""

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD"

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32 and indptr.device.type == "cpu"
        assert (num_kv_heads, page_size) == (1, 1) and bool((last_page_len == 1).all())
        self.indptr, self.indices, self.group, self.scale = (
            indptr.tolist(),
            indices.long(),
            num_qo_heads,
            kw["sm_scale"],
        )

    def run(self, q, kv, out=None):
        k, v = (x[:, 0, 0] for x in kv)
        assert q.shape[1] == self.group and q.is_contiguous()
        o = torch.empty_like(q) if out is None else out
        for r in range(q.shape[0]):
            pages = self.indices[self.indptr[r] : self.indptr[r + 1]]
            o[r] = ((q[r] @ k[pages].T) * self.scale).softmax(-1) @ v[pages]
        return o


@pytest.mark.parametrize("out_layout", ["contiguous", "head slice"])
def test_flashinfer_decode_drives_the_wrapper_as_the_reference(monkeypatch, out_layout):
    """FlashInferSparseDecode's requests, q/out views and plan arguments, with a torch stand-in for
    FlashInfer's wrapper (on CPU; the real one: the CUDA tests below)."""
    import types

    monkeypatch.setitem(
        sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper)
    )
    from sgl_loopkv.attention.decode_gpu import FlashInferSparseDecode

    g = torch.Generator().manual_seed(7)
    q, k, v, indptr, slots = random_case(g, 2, 3, 3, 16, [1, 17, 64, 65, 5, 200])
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))  # not fp32 (which runs the Triton kernel)
    fi = FlashInferSparseDecode(workspace_bytes=16, device="cpu")
    out_wide = torch.full((2, 12, 16), math.nan, dtype=q.dtype)
    out = out_wide[:, 2:11] if out_layout == "head slice" else out_wide[:, :9].contiguous()
    fi(q, k, v, indptr, slots, 0.3, out)
    ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.3, q.double())
    assert rel_err(out, ref) < TOL[torch.bfloat16]


# (B, Hkv, g, D, list lengths): SmolLM2's 3 x 3 heads of 64; MHA; g = 8 with D = 128; g = 16 (the
# tl.dot path); one long sequence (splits); 8 sequences of 2K-key lists
def gpu_cases(g):
    rand = lambda n, lo, hi: torch.randint(lo, hi, (n,), generator=g).tolist()  # noqa: E731
    return [
        (4, 3, 3, 64, [1, 17, 64, 65, 300, 1000, *rand(6, 1, 3000)]),
        (3, 4, 1, 64, rand(12, 1, 2000)),
        (2, 2, 8, 128, rand(4, 100, 5000)),
        (2, 1, 16, 64, [777, 3]),
        (1, 3, 3, 64, [8192, 5000, 33]),
        (8, 3, 3, 64, rand(24, 1500, 2100)),
    ]


def to_cuda(dtype, q, k, v, indptr, slots):
    return q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype), indptr.cuda(), slots.cuda()


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["fp32-products", "tensor-cores"])
def test_triton_matches_reference(dtype, tensor_cores):
    from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton

    if tensor_cores and dtype == torch.float32:
        pytest.skip("fp32 has no tensor-core path")
    g = torch.Generator().manual_seed(1)
    for B, H, G, D, lens in gpu_cases(g):
        q, k, v, indptr, slots = to_cuda(dtype, *random_case(g, B, H, G, D, lens, pool=12000))
        ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.125, q.double())
        out = sparse_decode_triton(
            q, k, v, indptr, slots, 0.125, torch.full_like(q, math.nan), tensor_cores=tensor_cores
        )
        assert rel_err(out, ref) < TOL[dtype], (B, H, G, D, dtype)


@gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 40])
def test_triton_splits_agree(splits):
    """Any split count (more splits than blocks in short lists: empty splits) gives the same output."""
    from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton

    g = torch.Generator().manual_seed(2)
    q, k, v, indptr, slots = to_cuda(torch.float32, *random_case(g, 2, 3, 3, 64, [4000, 1, 65, 2500, 100, 17]))
    ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.125, q.double())
    out = sparse_decode_triton(q, k, v, indptr, slots, 0.125, torch.full_like(q, math.nan), num_splits=splits)
    assert rel_err(out, ref) < TOL[torch.float32]


@gpu
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["fp32-products", "tensor-cores"])
def test_triton_reads_strided_views(tensor_cores):
    """q/out as head slices of wider buffers, the pool as one layer of a [P, layers, Hkv, D] buffer."""
    from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton

    g = torch.Generator().manual_seed(3)
    q, k, v, indptr, slots = to_cuda(torch.bfloat16, *random_case(g, 2, 3, 3, 64, [300, 2000, 1, 64, 65, 900]))
    q_wide = torch.randn(2, 20, 64, device="cuda", dtype=q.dtype)
    q_wide[:, 5:14] = q
    kv = torch.randn(k.shape[0], 2, 3, 64, device="cuda", dtype=q.dtype)
    kv[:, 1] = k
    out_wide = torch.full((2, 12, 64), math.nan, device="cuda", dtype=q.dtype)
    out = sparse_decode_triton(
        q_wide[:, 5:14], kv[:, 1], v, indptr, slots, 0.125, out_wide[:, 2:11], tensor_cores=tensor_cores
    )
    ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.125, q.double())
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert out_wide[:, :2].isnan().all() and out_wide[:, 11:].isnan().all()  # nothing written outside


def flashinfer_decode(**kwargs):
    pytest.importorskip("flashinfer")
    from sgl_loopkv.attention.decode_gpu import FlashInferSparseDecode

    return FlashInferSparseDecode(**kwargs)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)  # fp32: the Triton kernel behind the same API
@pytest.mark.parametrize("indptr_on", ["cpu", "cuda"])
def test_flashinfer_decode_matches_reference(dtype, indptr_on):
    fi = flashinfer_decode()
    g = torch.Generator().manual_seed(4)
    for B, H, G, D, lens in gpu_cases(g):
        q, k, v, indptr, slots = to_cuda(dtype, *random_case(g, B, H, G, D, lens, pool=12000))
        ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.125, q.double())
        out = fi(q, k, v, indptr.to(indptr_on), slots, 0.125, torch.full_like(q, math.nan))
        assert rel_err(out, ref) < TOL[dtype], (B, H, G, D, dtype)


@gpu
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_flashinfer_decode_plans_once_per_layer(tensor_cores):
    """One plan(), run() over two layers' buffers with the same lists; a non-contiguous out."""
    fi = flashinfer_decode(use_tensor_cores=tensor_cores)
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    q, k, v, indptr, slots = to_cuda(dtype, *random_case(g, 2, 3, 3, 64, [300, 2000, 1, 64, 65, 900]))
    fi.plan(indptr, slots, 3, 3, 64, 0.125, dtype)
    for layer in range(2):
        k2, v2 = (k, v) if layer == 0 else (k.flip(0).contiguous(), v.flip(0).contiguous())
        out_wide = torch.full((2, 12, 64), math.nan, device="cuda", dtype=dtype)
        out = fi.run(q, k2, v2, out_wide[:, 2:11])  # a head slice: not contiguous
        ref = sparse_decode_reference(q.double(), k2.double(), v2.double(), indptr, slots, 0.125, q.double())
        assert rel_err(out, ref) < TOL[dtype], layer
