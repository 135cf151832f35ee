"""Sparse and dense executors on a CUDA GPU against a float64 masked reference: the Triton
block-sparse kernel, the FlashInfer executor (one plan per layer) and the dense torch executor, on
random plans (GQA groups, block sizes 64 and 16, partial last blocks, cached prefixes, full heads,
columns) and on loopserve plans; fp16, bf16 and fp32. Outputs are poisoned with NaN first, so an
unwritten row fails. Skipped without CUDA (and the FlashInfer ones without flashinfer), except the
FlashInfer page lists, which are built on the CPU too and checked against a direct build."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_loopkv.attention import EXECUTORS, build_dense_plan
from sgl_loopkv.attention.sparse import SPARSE_EXECUTORS
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan
from tests.unit.test_sparse_kernels import random_batch
from tests.unit.test_sparse_plan import random_mask


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# ||out - ref|| / ||ref|| bounds: fp32 runs IEEE dots (no tf32); half types round p and the output
TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
# (kv_len, q_len, kv heads, group): partial last blocks, cached prefixes (q_len < kv_len), one row,
# SmolLM2's 3 x 3 heads
CASES = [(1000, 1000, 3, 3), (777, 300, 3, 3), (1100, 1, 2, 4), (2048, 2048, 1, 8), (130, 70, 4, 1), (3000, 1234, 3, 3)]


def masked_reference(q, k, v, mask: SeqMask, scale: float) -> torch.Tensor:
    """float64 softmax attention restricted to ``mask.dense_mask`` (on q's device); GQA spelled out."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    out = torch.empty(n, hq, v.shape[-1], dtype=torch.float64, device=q.device)
    for h in range(k.shape[1]):
        allowed = mask.dense_mask(h).to(q.device)
        s = torch.einsum("ngd,ld->gnl", q[:, h * g : (h + 1) * g].double(), k[:, h].double()) * scale
        out[:, h * g : (h + 1) * g] = torch.einsum(
            "gnl,ld->ngd", s.masked_fill(~allowed, -math.inf).softmax(-1), v[:, h].double()
        )
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    return float((out.double() - ref).norm() / ref.norm())


def tensors(g, L, n, hkv, group, d, dtype):
    q = torch.randn(n, hkv * group, d, generator=g)
    k, v = torch.randn(L, hkv, d, generator=g), torch.randn(L, hkv, d, generator=g)
    return (x.to("cuda", dtype) for x in (q, k, v))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [64, 16])
def test_triton_kernel_matches_reference(dtype, block):
    from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention

    g = torch.Generator().manual_seed(block)
    for L, n, hkv, group in CASES:
        for p in (0.1, 0.5):
            mask = random_mask(g, L, n, hkv, block, p)
            q, k, v = tensors(g, L, n, hkv, group, 64, dtype)
            out = torch.full_like(q, math.nan)
            block_sparse_attention(q, k, v, mask, 0.125, out=out)
            err = rel_err(out, masked_reference(q, k, v, mask, 0.125))
            assert err < TOL[dtype], (L, n, hkv, group, p, err)


@gpu
def test_triton_kernel_reads_strided_views():
    """q/k/v as views into larger buffers (a pool slice, a head slice) need no copy."""
    from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention

    g = torch.Generator().manual_seed(1)
    L, n = 700, 500
    mask = random_mask(g, L, n, 2, 64, 0.3)
    q_big, k_big, v_big = tensors(g, L + 50, n + 50, 2, 6, 64, torch.float16)
    q, k, v = q_big[10 : 10 + n, ::2], k_big[20 : 20 + L], v_big[30 : 30 + L]
    out = block_sparse_attention(q, k, v, mask, 0.125)
    assert rel_err(out, masked_reference(q, k, v, mask, 0.125)) < TOL[torch.float16]


def cuda_batch(seed: int, dtype, block: int, dense: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    seqs = [(1500, 1500), (900, 333), (200, 130), (1030, 1030)]
    plan, q, k_cache, v_cache = random_batch(g, seqs, hkv=3, group=3, d=64, block=block, p=0.25, dense=dense)
    plan.base.kv_indices = plan.base.kv_indices.cuda()
    return plan, *(x.to("cuda", dtype) for x in (q, k_cache, v_cache))


def batch_reference(plan: SparsePlan, q, k_cache, v_cache, scale):
    base, out = plan.base, []
    for i, mask in enumerate(plan.masks):
        q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
        k, v = base.kv_of(i, k_cache), base.kv_of(i, v_cache)
        mask = mask or SeqMask.all_blocks(k.shape[1], k.shape[0], q1 - q0, 64)
        out.append(masked_reference(q[q0:q1], k, v, mask, scale))
    return torch.cat(out)


def flashinfer_executor(backend: str = "auto"):
    pytest.importorskip("flashinfer")
    from sgl_loopkv.attention.sparse.flashinfer import FlashInferSparseExecutor

    return FlashInferSparseExecutor(backend=backend)


@gpu
@pytest.mark.parametrize("executor", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [64, 16])
def test_executors_on_a_batch(executor, dtype, block):
    """A batch in a shuffled KV pool: sparse sequences (cached prefix, partial blocks) and one the
    policy left dense (dense executor); fp32 on the flashinfer executor runs the Triton kernel."""
    if executor == "flashinfer":
        pytest.importorskip("flashinfer")
    ex = SPARSE_EXECUTORS.create(executor)
    plan, q, k_cache, v_cache = cuda_batch(block, dtype, block, dense=(3,))
    out = ex.run(plan, q, k_cache, v_cache, 0.125, torch.full_like(q, math.nan))
    assert rel_err(out, batch_reference(plan, q, k_cache, v_cache, 0.125)) < TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", [64, 16])
@pytest.mark.parametrize("backend", ["auto", "fa2"])  # auto: fa3 on Hopper
def test_flashinfer_matches_reference(dtype, block, backend):
    ex = flashinfer_executor(backend)
    g = torch.Generator().manual_seed(block + 1)
    for L, n, hkv, group in CASES:
        mask = random_mask(g, L, n, hkv, block, 0.3)
        q, k, v = tensors(g, L, n, hkv, group, 64, dtype)
        base = build_dense_plan(torch.arange(L, dtype=torch.int32)[None], [0], [L], [n])
        out = ex.run(SparsePlan(base, [mask]), q, k, v, 0.125, torch.full_like(q, math.nan))
        err = rel_err(out, masked_reference(q, k, v, mask, 0.125))
        assert err < TOL[dtype], (L, n, hkv, group, err)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_loopserve_plans(dtype):
    """Plans from the loopserve policy (random q/k, so mostly slash blocks and a dense tail)."""
    from sgl_loopkv.attention.policies.loopserve import VerticalSlashPolicy
    from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention

    g = torch.Generator().manual_seed(3)
    L, n = 4096, 3000
    q, k, v = tensors(g, L, n, 3, 3, 64, dtype)
    policy = VerticalSlashPolicy(alpha=0.5, dense_tail=64, tail_samples=16, full_density=0.6)
    mask = policy.select(0, q.float().cpu(), k.float().cpu(), 0.125)
    ref = masked_reference(q, k, v, mask, 0.125)
    assert rel_err(block_sparse_attention(q, k, v, mask, 0.125), ref) < TOL[dtype]
    ex = flashinfer_executor()
    base = build_dense_plan(torch.arange(L, dtype=torch.int32)[None], [0], [L], [n])
    out = ex.run(SparsePlan(base, [mask]), q, k, v, 0.125, torch.full_like(q, math.nan))
    assert rel_err(out, ref) < TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["one run", "shuffled", "few runs"])
def test_dense_executor_on_cuda(dtype, layout):
    """executor.py's torch executor: SDPA over a view (one run), a gathered prefix (shuffled
    slots) and the run-wise path (few runs, <= 64 new rows)."""
    g = torch.Generator().manual_seed(7)
    hkv, group, d = 3, 3, 64
    seqs = [(900, 900), (700, 250), (400, 1)] if layout != "few runs" else [(900, 64), (400, 1), (300, 17)]
    pool = 4096
    req_to_token = torch.zeros(len(seqs), 1024, dtype=torch.int32)
    free = torch.randperm(pool, generator=g) if layout == "shuffled" else torch.arange(pool)
    used = 0
    for r, (L, _) in enumerate(seqs):
        slots = free[used : used + L]
        if layout == "few runs":  # 3 runs of pages: a paged pool after some eviction
            slots = torch.cat([slots[L // 2 :] + 100, slots[: L // 2] + 2000])
        req_to_token[r, :L] = slots.to(torch.int32)
        used += L + 50
    plan = build_dense_plan(req_to_token, list(range(len(seqs))), [L for L, _ in seqs], [n for _, n in seqs])
    plan.kv_indices = plan.kv_indices.cuda()
    k_cache, v_cache = (torch.randn(pool, hkv, d, generator=g).to("cuda", dtype) for _ in range(2))
    q = torch.randn(sum(n for _, n in seqs), hkv * group, d, generator=g).to("cuda", dtype)
    out = EXECUTORS.create("torch").run(plan, q, k_cache, v_cache, 0.125, torch.full_like(q, math.nan))
    ref = batch_reference(SparsePlan(plan, [None] * len(seqs)), q, k_cache, v_cache, 0.125)
    # SDPA on fp32 CUDA may use tf32-free math/efficient kernels; half types as above
    assert rel_err(out, ref) < max(TOL[dtype], 1e-4)


def column_mask(g, L: int, n: int, heads: int, block: int, p: float, max_cols: int) -> SeqMask:
    """random_mask with up to ``max_cols`` columns per head (LoopServe-like: many fall in selected
    blocks, so the page lists must drop them there)."""
    nb, qb0 = -(-L // block), (L - n) // block
    table = torch.rand(heads, nb - qb0, nb, generator=g) < p
    cols = [torch.randperm(L, generator=g)[: int(torch.randint(0, max_cols, (1,), generator=g))] for _ in range(heads)]
    full = [bool(torch.rand(1, generator=g) < 0.2) for _ in range(heads)]
    return SeqMask.from_block_table(table, L, n, block, cols, full)


def direct_requests(plan: SparsePlan, H: int):
    """The FlashInfer requests spelled out request by request: (qo_indptr, kv_indptr, pages)."""
    qo, kv, pages = [0], [0], []
    for i, mask in enumerate(plan.masks):
        if mask is None or not plan.base.q_len(i):
            continue
        slots = plan.base.kv_slots(i).cpu().long()
        B, L = mask.block_size, mask.kv_len
        for h in range(H):
            if mask.full[h]:
                reqs = [(mask.q_len, list(range(L)))]
            else:
                reqs = []
                for qb in range(mask.first_q_block, mask.num_blocks):
                    s, e = qb * B, min(qb * B + B, L)
                    *earlier, diag = mask.blocks(h, qb).tolist()
                    assert diag == qb
                    keys = [b * B + t for b in earlier for t in range(B)]
                    keys += [c for c in mask.cols(h).tolist() if c < s and c // B not in earlier]
                    reqs.append((e - max(s, mask.prefix_len), keys + list(range(s, e))))
            for rows, keys in reqs:
                qo.append(qo[-1] + rows)
                kv.append(kv[-1] + len(keys))
                pages += (slots[keys] * H + h).tolist()
    return qo, kv, pages


def random_column_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    block = [8, 16, 64][seed % 3]
    seqs = []
    for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
        L = int(torch.randint(1, 700, (1,), generator=g))
        seqs.append((L, int(torch.randint(1, L + 1, (1,), generator=g))))
    plan, *_ = random_batch(g, seqs, hkv=3, group=2, d=8, block=block, dense=(1,) if seed % 4 == 0 else ())
    p = float(torch.rand(1, generator=g))
    plan.masks = [m and column_mask(g, m.kv_len, m.q_len, 3, block, p, 200) for m in plan.masks]
    return plan


@pytest.mark.parametrize("seed", range(12))
def test_request_lists_equal_a_direct_build(seed):
    """build_requests (vectorised) on the CPU == the request-by-request build: several sequences,
    cached prefixes, partial blocks, full heads, a dense sequence, many columns."""
    from sgl_loopkv.attention.sparse.flashinfer import build_requests

    plan = random_column_batch(seed)
    reqs = build_requests(plan, 3, "cpu")
    qo, kv, pages = direct_requests(plan, 3)
    assert reqs.qo_indptr.tolist() == qo and reqs.kv_indptr.tolist() == kv
    assert reqs.kv_indices.tolist() == pages
    assert reqs.kv_lens.tolist() == torch.tensor(kv).diff().tolist() and bool((reqs.last_page_len == 1).all())


def long_full_head_batch():
    """Full heads longer than a kernel program's chunk (4096 keys), next to a sparse head."""
    g = torch.Generator().manual_seed(5)
    plan, *_ = random_batch(g, [(9000, 5000), (4100, 4100)], hkv=2, group=2, d=8, block=64)
    masks = []
    for m in plan.masks:
        c = column_mask(g, m.kv_len, m.q_len, 2, 64, 0.1, 300)
        cols = [c.cols(h) for h in range(2)]
        masks.append(SeqMask.from_block_table(c.block_table(), c.kv_len, c.q_len, 64, cols, [True, False]))
    plan.masks = masks
    return plan


@gpu
def test_request_lists_on_cuda_equal_cpu():
    """The same lists built on the GPU (pinned uploads; the Triton kernel and the torch expansion)."""
    from sgl_loopkv.attention.sparse.flashinfer import build_requests

    for plan in [random_column_batch(seed) for seed in range(6)] + [long_full_head_batch()]:
        H = plan.masks[0].num_heads
        on_cpu = build_requests(plan, H, "cpu")
        plan.base.kv_indices = plan.base.kv_indices.cuda()
        for kernel in (True, False):
            on_gpu = build_requests(plan, H, "cuda", kernel=kernel)
            assert on_gpu.qo_indptr.tolist() == on_cpu.qo_indptr.tolist()
            assert on_gpu.kv_indptr.tolist() == on_cpu.kv_indptr.tolist()
            assert torch.equal(on_gpu.kv_indices.cpu(), on_cpu.kv_indices), kernel
