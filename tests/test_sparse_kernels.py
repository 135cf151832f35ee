"""The other sparse executors: the Triton block-sparse kernel under TRITON_INTERPRET=1 on CPU
(small sizes), the FlashInfer request layout emulated on CPU, and both on a GPU when one is
present (marked gpu, skipped without CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_loopkv.attention import build_dense_plan
from sgl_loopkv.attention.flashinfer_executor import request_keys
from sgl_loopkv.attention.sparse_executor import SPARSE_EXECUTORS
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan
from tests.helpers import run_fresh
from tests.test_sparse_plan import masked_reference, random_mask

TRITON_CHECK = """
import json, torch
from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention
from sgl_loopkv.attention.sparse_plan import SeqMask
from tests.test_sparse_plan import masked_reference, random_mask
g = torch.Generator().manual_seed(0)
errs = []
for L, n, hkv, group in [(64, 64, 1, 1), (80, 50, 2, 2), (100, 7, 2, 3), (48, 48, 1, 4)]:
    m = random_mask(g, L, n, hkv, 16, 0.4)
    q = torch.randn(n, hkv * group, 16, generator=g)
    k, v = torch.randn(L, hkv, 16, generator=g), torch.randn(L, hkv, 16, generator=g)
    errs.append(float((block_sparse_attention(q, k, v, m, 0.3) - masked_reference(q, k, v, m, 0.3)).abs().max()))
full = SeqMask.all_blocks(2, 96, 40, 16)
q, k, v = torch.randn(40, 4, 16, generator=g), torch.randn(96, 2, 16, generator=g), torch.randn(96, 2, 16, generator=g)
from sgl_loopkv.attention import dense_attention
errs.append(float((block_sparse_attention(q, k, v, full, 0.3) - dense_attention(q, k, v, 0.3)).abs().max()))
print(json.dumps({"errs": errs}))
"""


def test_triton_kernel_equals_masked_reference_in_the_interpreter():
    errs = run_fresh(TRITON_CHECK, env={"TRITON_INTERPRET": "1"})["errs"]
    assert len(errs) == 5 and max(errs) < 1e-5, errs


def flashinfer_semantics(q, k, v, mask: SeqMask, head: int, scale: float):
    """What FlashInfer computes for our requests: row i of a request with r rows and key list K sees
    K[: len(K) - r + i + 1] (causal, aligned to the last key)."""
    B, P, L = mask.block_size, mask.prefix_len, mask.kv_len
    out = []
    for j, keys in enumerate(request_keys(mask, head)):
        start = (mask.first_q_block + j) * B
        rows = torch.arange(max(P, start), min(L, start + B))
        s = (q[rows - P].double() @ k[keys].double().T) * scale
        visible = torch.arange(len(keys))[None, :] <= (len(keys) - len(rows) + torch.arange(len(rows)))[:, None]
        out.append(s.masked_fill(~visible, -math.inf).softmax(-1) @ v[keys].double())
    return torch.cat(out)


@pytest.mark.parametrize("seed", range(6))
def test_flashinfer_request_layout_reproduces_the_mask(seed):
    g = torch.Generator().manual_seed(seed)
    L = int(torch.randint(2, 150, (1,), generator=g))
    n = int(torch.randint(1, L + 1, (1,), generator=g))
    mask = random_mask(g, L, n, 2, 16, 0.35)
    q, k, v = torch.randn(n, 2, 8, generator=g), torch.randn(L, 2, 8, generator=g), torch.randn(L, 2, 8, generator=g)
    ref = masked_reference(q, k, v, mask, 0.3)
    for h in range(2):
        if not mask.full[h]:
            torch.testing.assert_close(flashinfer_semantics(q[:, h], k[:, h], v[:, h], mask, h, 0.3).float(), ref[:, h])


def gpu_batch(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    pool, hkv, hq, d = 1024, 2, 8, 64
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    seq_lens, q_lens, rows = [300, 40, 200], [300, 1, 130], [1, 0, 3]
    req_to_token = torch.zeros(4, 512, dtype=torch.int32)
    perm, used = torch.randperm(pool, generator=g), 0
    for r, n in zip(rows, seq_lens):
        req_to_token[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    base = build_dense_plan(req_to_token, rows, seq_lens, q_lens)
    masks = [random_mask(g, 300, 300, hkv, 16, 0.3), None, random_mask(g, 200, 130, hkv, 16, 0.3)]
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    ref = SPARSE_EXECUTORS.create("torch").run(SparsePlan(base, masks), q, k_cache, v_cache, 0.125, torch.empty_like(q))
    base.kv_indices = base.kv_indices.to(device)
    to = lambda x: x.to(device)  # noqa: E731
    return SparsePlan(base, masks), to(q), to(k_cache), to(v_cache), ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("executor", ["flashinfer", "triton"])
def test_gpu_executors_equal_the_torch_executor(executor):
    pytest.importorskip("flashinfer") if executor == "flashinfer" else None
    plan, q, k_cache, v_cache, ref = gpu_batch(0, "cuda")
    out = SPARSE_EXECUTORS.create(executor).run(plan, q, k_cache, v_cache, 0.125, torch.empty_like(q))
    torch.testing.assert_close(out.cpu(), ref, atol=2e-3, rtol=2e-3)  # tf32/fp32 accumulation on the GPU
