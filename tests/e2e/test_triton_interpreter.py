"""The Triton kernels on CPU under ``TRITON_INTERPRET=1``, each in a fresh interpreter (the variable is
read at import): the block-sparse attention kernel and the FlashInfer executor's page-list kernel.
Small sizes; the same kernels on a GPU: tests/unit/test_sparse_gpu.py."""

from __future__ import annotations

from tests.helpers import run_fresh

TRITON_CHECK = """
import json, torch
from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention
from sgl_loopkv.attention.sparse_plan import SeqMask
from tests.unit.test_sparse_plan import masked_reference, random_mask
g = torch.Generator().manual_seed(0)
errs = []
for L, n, hkv, group, d in [(64, 64, 1, 1, 16), (80, 50, 2, 2, 16), (100, 7, 2, 3, 16), (48, 48, 1, 4, 16), (70, 70, 1, 2, 24)]:
    m = random_mask(g, L, n, hkv, 16, 0.4)
    q = torch.randn(n, hkv * group, d, generator=g)
    k, v = torch.randn(L, hkv, d, generator=g), torch.randn(L, hkv, d, generator=g)
    errs.append(float((block_sparse_attention(q, k, v, m, 0.3) - masked_reference(q, k, v, m, 0.3)).abs().max()))
full = SeqMask.all_blocks(2, 96, 40, 16)
q, k, v = torch.randn(40, 4, 16, generator=g), torch.randn(96, 2, 16, generator=g), torch.randn(96, 2, 16, generator=g)
from sgl_loopkv.attention import dense_attention
errs.append(float((block_sparse_attention(q, k, v, full, 0.3) - dense_attention(q, k, v, 0.3)).abs().max()))
print(json.dumps({"errs": errs}))
"""


EXPAND_CHECK = """
import json, torch
from sgl_loopkv.attention.sparse.flashinfer import build_requests
from tests.unit.test_sparse_gpu import long_full_head_batch, random_column_batch
plans = [random_column_batch(seed) for seed in range(6)] + [long_full_head_batch()]
print(json.dumps({"equal": [
    torch.equal(build_requests(p, p.masks[0].num_heads, "cpu", kernel=True).kv_indices,
                build_requests(p, p.masks[0].num_heads, "cpu", kernel=False).kv_indices)
    for p in plans
]}))
"""


def test_triton_kernel_equals_masked_reference_in_the_interpreter():
    errs = run_fresh(TRITON_CHECK, env={"TRITON_INTERPRET": "1"})["errs"]
    assert len(errs) == 6 and max(errs) < 1e-5, errs


def test_expand_kernel_equals_torch_expansion_in_the_interpreter():
    """The Triton page-list kernel (the GPU path) == the torch expansion, under TRITON_INTERPRET=1."""
    assert all(run_fresh(EXPAND_CHECK, env={"TRITON_INTERPRET": "1"})["equal"])
