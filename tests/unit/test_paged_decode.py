"""Decode attention over a paged, fragmented KV pool: the native kernel and the torch paths against
a float64 reference, batch invariance, and the rule that picks the path."""

from __future__ import annotations

import shutil

import pytest
import torch

from sgl_loopkv.attention.executor import DECODE_VIEW_MAX_RUNS, DecodePath, TorchDenseExecutor
from sgl_loopkv.attention.plan import build_dense_plan
from sgl_loopkv.kernels import paged_decode


def reference(q, k_cache, v_cache, slots_per_seq, scale):
    """softmax(q K^T * scale) V per sequence in float64, GQA expanded by hand."""
    out = []
    for i, slots in enumerate(slots_per_seq):
        k, v = k_cache[slots].double(), v_cache[slots].double()
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", probs, v))
    return torch.stack(out)


def fragmented_batch(seed, lens, hq=9, hkv=3, d=64, pool=4096, page=16, dtype=torch.float32):
    """A pool whose sequences own shuffled pages (what eviction and resumes leave behind)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    pages = torch.randperm(pool // page, generator=g).tolist()
    req_to_token = torch.zeros(len(lens), max(lens) + page, dtype=torch.int32)
    slots_per_seq = []
    for i, n in enumerate(lens):
        own, pages = pages[: -(-n // page)], pages[-(-n // page) :]
        slots = torch.cat([torch.arange(p * page, (p + 1) * page) for p in own])[:n]
        req_to_token[i, :n] = slots.to(torch.int32)
        slots_per_seq.append(slots)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    plan = build_dense_plan(req_to_token, list(range(len(lens))), list(lens), [1] * len(lens))
    return q, k_cache, v_cache, slots_per_seq, plan


@pytest.fixture(scope="module")
def native():
    module = paged_decode.load()
    if module is None:
        pytest.skip("no C++ toolchain: the native kernel is unavailable (the torch paths are tested below)")
    return module


def test_kernel_builds_where_a_compiler_exists():
    """install.sh builds it; a machine with a compiler must not silently fall back."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert paged_decode.load() is not None


def test_kernel_spreads_work_over_torchs_threads_with_torchs_openmp(native):
    """Built without OpenMP, at::parallel_for (a header template) ran the kernel on one core; built
    with it, the extension must use the OpenMP runtime torch loaded, not a second thread pool."""
    assert native.intra_op_parallel()
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes


@pytest.mark.parametrize("lens", [[1], [37], [300, 5, 1024], [4000, 16, 700, 1]])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
def test_native_kernel_equals_reference(native, lens, hq, hkv):
    q, k_cache, v_cache, slots, plan = fragmented_batch(len(lens) * 7 + hq, lens, hq, hkv, d=64, pool=8192)
    out = torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, out, 256)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, slots, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_native_kernel_half_precision_pools(native, dtype, tol):
    q, k_cache, v_cache, slots, plan = fragmented_batch(3, [513, 64], dtype=dtype)
    out = torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, out, 256)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, slots, 0.125), atol=tol, rtol=tol)


def test_native_kernel_result_does_not_depend_on_the_batch(native):
    """Splits follow a sequence's own length: alone or among others, bit-identical output (greedy
    decoding does not change with concurrency)."""
    q, k_cache, v_cache, slots, plan = fragmented_batch(5, [3000, 40, 1500], pool=8192)
    out = torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, out, 256)
    for i, s in enumerate(slots):
        alone = torch.empty_like(q[i : i + 1])
        native.paged_decode(q[i : i + 1], k_cache, v_cache, s, torch.tensor([0, len(s)]), 0.125, alone, 256)
        assert torch.equal(alone, out[i : i + 1])


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (16, 2, 64), (32, 8, 128), (12, 4, 128), (5, 5, 32)])
def test_native_kernel_head_geometries(native, hq, hkv, d):
    """Query rows per KV head of 1-8 taken in register groups of up to four (7 = 4 + 3), head dim
    64 and 128 on the every-head path, any other head dim on the per-head one."""
    q, k_cache, v_cache, slots, plan = fragmented_batch(hq + d, [700, 63, 1], hq, hkv, d=d, pool=2048)
    out = torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, out, 256)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, slots, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_heads_result_does_not_depend_on_the_other_heads(native, dtype):
    """Sparse decode runs one KV head at a time (the pool viewed as one-head rows); at full budget it
    must give the dense step's bits, so a head's output may not depend on its neighbours."""
    q, k_cache, v_cache, slots, plan = fragmented_batch(9, [1500], 9, 3, dtype=dtype)
    out = torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, out, 256)
    for h in range(3):
        one = torch.empty_like(q[:, 3 * h : 3 * h + 3])
        kh, vh = k_cache[:, h : h + 1].contiguous(), v_cache[:, h : h + 1].contiguous()
        native.paged_decode(
            q[:, 3 * h : 3 * h + 3].contiguous(), kh, vh, plan.kv_indices, plan.kv_indptr_tensor, 0.125, one, 256
        )
        assert torch.equal(one, out[:, 3 * h : 3 * h + 3])


def test_native_kernel_rejects_bad_layouts(native):
    q, k_cache, v_cache, _, plan = fragmented_batch(1, [32])
    with pytest.raises(RuntimeError, match="indptr"):
        native.paged_decode(q, k_cache, v_cache, plan.kv_indices, torch.tensor([0, 16, 32]), 0.1, q.clone(), 256)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        kt = k_cache.transpose(1, 2)
        native.paged_decode(q, kt, kt, plan.kv_indices, plan.kv_indptr_tensor, 0.1, q.clone(), 256)


@pytest.mark.parametrize("native_decode", [True, False])
def test_executor_decode_equals_reference_on_a_fragmented_pool(native_decode):
    q, k_cache, v_cache, slots, plan = fragmented_batch(11, [2000, 17, 600])
    ex = TorchDenseExecutor(native_decode=native_decode)
    out = ex.run(plan, q, k_cache, v_cache, 0.125, torch.empty_like(q))
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, slots, 0.125), atol=2e-6, rtol=1e-5)
    expected = DecodePath.NATIVE if ex.native is not None else DecodePath.GATHER
    assert ex.last_decode_path is expected and ex.decode_paths[expected] == 1


def test_torch_decode_reads_views_when_the_pool_is_not_fragmented():
    """Without the kernel: few runs per sequence -> run views; many -> gather (the measured rule)."""
    few = [torch.arange(0, 40), torch.arange(1000, 1016)]
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    for i, s in enumerate(few):
        req_to_token[i, : len(s)] = s.to(torch.int32)
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(2048, 2, 8, generator=g), torch.randn(2048, 2, 8, generator=g)
    q = torch.randn(2, 4, 8, generator=g)
    plan = build_dense_plan(req_to_token, [0, 1], [40, 16], [1, 1])
    ex = TorchDenseExecutor(native_decode=False)
    out = ex.run(plan, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    assert ex.last_decode_path is DecodePath.VIEWS
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, few, 0.3), atol=1e-5, rtol=1e-5)
    _, _, _, _, fragmented = fragmented_batch(4, [16 * (DECODE_VIEW_MAX_RUNS + 2)], hq=4, hkv=2, d=8)
    assert ex.decode_path(fragmented, k_cache) is DecodePath.GATHER


def extend_reference(q, k_cache, v_cache, slots, scale):
    """Causal attention of the n rows of ``q`` over ``slots`` (the last n their own) in float64."""
    n, L = q.shape[0], len(slots)
    k, v = k_cache[slots].double(), v_cache[slots].double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    s = s.masked_fill(torch.arange(L)[None, :] > (L - n + torch.arange(n))[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,L,hq,hkv,d",
    [
        (2, 17, 9, 3, 64),
        (5, 100, 9, 3, 64),
        (16, 416, 9, 3, 64),
        (32, 2048, 9, 3, 64),
        (9, 9, 4, 4, 128),
        (13, 300, 8, 2, 128),
    ],
)
def test_extend_kernel_matches_causal_attention(native, dtype, n, L, hq, hkv, d):
    """A few new rows over their keys read in place through scattered 16-slot chunks: every output
    within the pool dtype's rounding of the float64 reference, causal (row r sees L - n + r + 1 keys;
    n == L: a square), GQA groups of 1-4, head dims 64 and 128, rows past the last block of 8."""
    g = torch.Generator().manual_seed(n * 1000 + L)
    pool = 8192
    k_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, hkv, d, generator=g).to(dtype)
    chunks = torch.randperm(pool // 16, generator=g)[: -(-L // 16)]
    slots = (chunks[:, None] * 16 + torch.arange(16)).flatten()[:L].contiguous()
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    native.extend_attention(q, k_cache, v_cache, slots, d**-0.5, out)
    ref = extend_reference(q, k_cache, v_cache, slots, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_executor_extends_take_the_native_kernel_up_to_its_rows(native):
    """The executor sends causal extends of up to EXTEND_NATIVE_MAX_ROWS rows to the kernel and the
    rest to torch; both give the same outputs within float32 rounding."""
    from sgl_loopkv.attention import executor as ex
    from sgl_loopkv.attention.plan import AttentionPlan

    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(4096, 3, 64, generator=g), torch.randn(4096, 3, 64, generator=g)
    calls = []
    real = native.extend_attention

    class Spy:
        def __getattr__(self, name):
            return getattr(native, name)

        def extend_attention(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    for n in (2, ex.EXTEND_NATIVE_MAX_ROWS, ex.EXTEND_NATIVE_MAX_ROWS + 1):
        L = 700
        slots = torch.randperm(4096, generator=g)[:L]
        plan = AttentionPlan([0, n], [0, L], slots, True)
        q = torch.randn(n, 9, 64, generator=g)
        executor = TorchDenseExecutor()
        executor.native = Spy()
        out = executor.run(plan, q, k_cache, v_cache, 0.125, torch.empty_like(q))
        torch.testing.assert_close(
            out.double(), extend_reference(q, k_cache, v_cache, slots, 0.125), atol=1e-5, rtol=1e-5
        )
    assert calls == [2, ex.EXTEND_NATIVE_MAX_ROWS]


def test_the_kernels_build_cache_is_keyed_by_source_and_torch_path(monkeypatch, tmp_path):
    """Two checkouts, or one venv seen under two paths (a worktree's symlink), build apart instead
    of rebuilding each other's kernels at every start (the build command names both paths)."""
    from sgl_loopkv.kernels.native import _build_key

    src = tmp_path / "paged_decode.cpp"
    key = _build_key(src)
    assert _build_key(src) == key
    assert _build_key(tmp_path / "other" / "paged_decode.cpp") != key
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv-link" / "torch" / "__init__.py"))
    assert _build_key(src) != key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_decode_paths_agree(native, dtype):
    """Every-head items (what head dims 64 and 128 take) and one-head items (any other): the same
    attention within float32 rounding of each other, over a fragmented pool."""
    q, k_cache, v_cache, slots, plan = fragmented_batch(21, [2000, 300, 17], dtype=dtype, pool=4096)
    q = q.float()
    a, b = torch.empty_like(q), torch.empty_like(q)
    native.paged_decode(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, a, 256)
    native.paged_decode_per_head(q, k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, 0.125, b, 256)
    torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(a.double(), reference(q, k_cache, v_cache, slots, 0.125), atol=2e-6, rtol=1e-5)
