"""The Triton kernels on CPU under ``TRITON_INTERPRET=1``, in a fresh interpreter (the variable is read
at import; one interpreter runs the three checks): the block-sparse attention kernel, the FlashInfer
executor's page-list kernel and the sparse decode kernel. Small sizes; the same kernels on a GPU:
tests/unit/test_sparse_gpu.py and tests/unit/test_sparse_decode_gpu.py."""

from __future__ import annotations

import pytest

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
OUT["attention"] = errs
"""


EXPAND_CHECK = """
import json, torch
from sgl_loopkv.attention.sparse.flashinfer import build_requests
from tests.unit.test_sparse_gpu import long_full_head_batch, random_column_batch
plans = [random_column_batch(seed) for seed in range(6)] + [long_full_head_batch()]
OUT["expand"] = [
    torch.equal(build_requests(p, p.masks[0].num_heads, "cpu", kernel=True).kv_indices,
                build_requests(p, p.masks[0].num_heads, "cpu", kernel=False).kv_indices)
    for p in plans
]
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Each check's result (``OUT[name]``), all from one interpreter: one start of torch and Triton."""
    code = "\n".join(
        ["import json", "OUT = {}", TRITON_CHECK, EXPAND_CHECK, SPARSE_DECODE_CHECK, "print(json.dumps(OUT))"]
    )
    return run_fresh(code, env={"TRITON_INTERPRET": "1"})


def test_triton_kernel_equals_masked_reference_in_the_interpreter(interpreted):
    errs = interpreted["attention"]
    assert len(errs) == 6 and max(errs) < 1e-5, errs


def test_expand_kernel_equals_torch_expansion_in_the_interpreter(interpreted):
    """The Triton page-list kernel (the GPU path) == the torch expansion, under TRITON_INTERPRET=1."""
    assert interpreted["expand"] and all(interpreted["expand"])


SPARSE_DECODE_CHECK = """
import json, torch
from sgl_loopkv.attention.decode_gpu import sparse_decode_reference
from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton
from tests.unit.test_sparse_decode_gpu import random_case
g = torch.Generator().manual_seed(0)
errs = []
# (B, Hkv, g, D, list lengths, splits): GQA 3 and MHA, lengths 1 and off the block size, one long
# list split in 1, 3 and 4 parts (empty splits too: 4 splits of whole 64-key blocks leave the last
# one of a 150-key list empty), g = 16 (the tl.dot path)
for B, H, G, D, lens, splits in [
    (2, 2, 3, 16, [1, 17, 64, 65], None),
    (3, 1, 1, 32, [5, 100, 33], None),
    (1, 2, 3, 16, [300, 1], 1),
    (1, 2, 3, 16, [300, 150], 3),
    (2, 1, 1, 32, [301, 150], 4),
    (1, 1, 16, 16, [70], 2),
]:
    q, k, v, indptr, slots = random_case(g, B, H, G, D, lens, pool=400)
    ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.3, q.double())
    out = sparse_decode_triton(q, k, v, indptr, slots, 0.3, torch.full_like(q, float("nan")), num_splits=splits)
    errs.append(float((out.double() - ref).abs().max()))
# the tensor-core path (fp16 K/V straight into tl.dot, the group padded to 16; the interpreter's
# bf16 dots are wrong, so bf16 is checked on a GPU only), unsplit and split
errs16 = []
for B, H, G, D, lens, splits in [(2, 2, 3, 16, [1, 17, 64, 65], None), (1, 2, 3, 32, [300, 150], 3)]:
    q, k, v, indptr, slots = random_case(g, B, H, G, D, lens, pool=400)
    q, k, v = q.half(), k.half(), v.half()
    ref = sparse_decode_reference(q.double(), k.double(), v.double(), indptr, slots, 0.3, q.double())
    out = sparse_decode_triton(
        q, k, v, indptr, slots, 0.3, torch.full_like(q, float("nan")), num_splits=splits, tensor_cores=True
    )
    errs16.append(float((out.double() - ref).norm() / ref.norm()))
OUT["decode"] = {"errs": errs, "errs16": errs16}
"""


def test_sparse_decode_kernel_equals_reference_in_the_interpreter(interpreted):
    """The Triton sparse-decode kernel (fp32, and fp16 on its tensor-core path) == the torch
    reference: GQA and MHA, per-head lists of different lengths, the split-K merge."""
    res = interpreted["decode"]
    errs, errs16 = res["errs"], res["errs16"]
    assert len(errs) == 6 and max(errs) < 1e-5, errs
    assert len(errs16) == 2 and max(errs16) < 3e-3, errs16  # fp16 rounding of p (test_sparse_decode_gpu's TOL)
