"""The FlashInfer executor's request layout on CPU, run through an emulation of FlashInfer's paged
prefill. The Triton kernels under TRITON_INTERPRET=1: tests/e2e/test_triton_interpreter.py; the same
executors on a GPU: tests/unit/test_sparse_gpu.py (helpers shared from here)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_loopkv.attention import build_dense_plan
from sgl_loopkv.attention.sparse import SPARSE_EXECUTORS
from sgl_loopkv.attention.sparse.flashinfer import FlashInferSparseExecutor
from sgl_loopkv.attention.sparse_plan import SparsePlan
from tests.unit.test_sparse_plan import random_mask


def random_batch(
    g: torch.Generator,
    seqs: list[tuple[int, int]],
    hkv: int = 2,
    group: int = 4,
    d: int = 64,
    block: int = 16,
    p: float = 0.3,
    dense: tuple[int, ...] = (),
):
    """A batch of sequences (kv_len, q_len) whose keys sit at shuffled slots of a KV pool, with a
    random mask per sequence (None for the indices in ``dense``). Returns (plan, q, k_cache,
    v_cache), all on the CPU in fp32."""
    pool = sum(L for L, _ in seqs) + 37
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    req_to_token = torch.zeros(len(seqs) + 1, max(L for L, _ in seqs), dtype=torch.int32)
    perm, used = torch.randperm(pool, generator=g), 0
    for r, (L, _) in enumerate(seqs):
        req_to_token[r + 1, :L] = perm[used : used + L].to(torch.int32)
        used += L
    base = build_dense_plan(req_to_token, list(range(1, len(seqs) + 1)), [L for L, _ in seqs], [n for _, n in seqs])
    masks = [None if i in dense else random_mask(g, L, n, hkv, block, p) for i, (L, n) in enumerate(seqs)]
    q = torch.randn(sum(n for _, n in seqs), hkv * group, d, generator=g)
    return SparsePlan(base, masks), q, k_cache, v_cache


class EmulatedPrefill:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper (NHD, causal) in float64 on the CPU: row i
    of a request with r rows and page list K sees K[: len(K) - r + i + 1] (causal, aligned to the
    last key); a page is [page_size, num_kv_heads, D] (here 1 x 1)."""

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, **kw):
        assert (hkv, page_size) == (1, 1) and kw["causal"] and bool((last_page_len == 1).all())
        self.calls = getattr(self, "calls", 0) + 1
        self.args = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.cpu().long(), kw["sm_scale"])

    def run(self, q, kv):
        (qo, kvp, pages, scale), (k, v) = self.args, kv
        out = torch.empty_like(q)
        for r in range(len(qo) - 1):
            keys = pages[kvp[r] : kvp[r + 1]]
            rows = qo[r + 1] - qo[r]
            s = torch.einsum("rgd,kd->grk", q[qo[r] : qo[r + 1]].double(), k[keys, 0, 0].double()) * scale
            seen = torch.arange(len(keys))[None, :] <= (len(keys) - rows + torch.arange(rows))[:, None]
            p = s.masked_fill(~seen, -math.inf).softmax(-1)
            out[qo[r] : qo[r + 1]] = torch.einsum("grk,kd->rgd", p, v[keys, 0, 0].double()).to(q.dtype)
        return out


def emulated_flashinfer_executor() -> FlashInferSparseExecutor:
    ex = FlashInferSparseExecutor.__new__(FlashInferSparseExecutor)  # no CUDA workspace
    ex._wrapper, ex.dense, ex._triton = EmulatedPrefill(), SPARSE_EXECUTORS.create("torch").dense, None
    return ex


@pytest.mark.parametrize("seed", range(6))
def test_flashinfer_requests_reproduce_the_masks(seed):
    """One plan over all heads and sequences (sparse, full heads, dense, cached prefix, partial last
    blocks) gives, through FlashInfer's causal semantics, what the torch executor computes."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(3):
        L = int(torch.randint(2, 150, (1,), generator=g))
        seqs.append((L, int(torch.randint(1, L + 1, (1,), generator=g))))
    plan, q, k_cache, v_cache = random_batch(g, seqs, hkv=2, group=3, d=8, p=0.35, dense=(1,) if seed % 2 else ())
    ref = SPARSE_EXECUTORS.create("torch").run(plan, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    ex = emulated_flashinfer_executor()
    out = ex.run(plan, q, k_cache, v_cache, 0.3, torch.full_like(q, math.nan))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert ex._wrapper.calls == 1  # one plan() per layer for every sequence and head
