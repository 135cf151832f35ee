"""Block-sparse prefill attention in Triton, driven by a :class:`~sgl_loopkv.attention.sparse_plan.SeqMask`.

One program per (query head, query block): it walks the CSR list of its KV head's selected key
blocks (a causal mask only bites in the diagonal block), then the head's columns in chunks (each
skipped when a selected block already holds it, or when it is not before the query block), with
an online softmax, FlashAttention style. Only the listed work is done, like LServe's iterator.

q, k, v are read in place (any row/head strides, e.g. a view into the KV pool); rows before the
new rows (cached prefix) and past ``kv_len`` are masked, not padded. Programs are ordered query
block outermost, last block first (the causally heaviest go first) and the query heads of one KV
head adjacent (they read the same key blocks, which then come from L2).

Block size and head dim: powers of two >= 16 on a GPU (``tl.dot``); any head dim is padded. fp16 and
bf16 run the tensor cores with fp32 accumulation; fp32 inputs use IEEE fp32 dots (no tf32).
Tested on CPU under ``TRITON_INTERPRET=1`` (tests/e2e/test_triton_interpreter.py) and on an H100
(tests/unit/test_sparse_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _block_sparse_attn_kernel(
    Q,
    K,
    V,
    Out,  # Q/Out [n, Hq, D] (the new rows only); K/V [L, Hkv, D]
    block_indptr,
    block_indices,
    col_indptr,
    col_end,  # [Hkv * nqb]: end of the head's columns before the query block (they are sorted)
    col_indices,
    member,  # [Hkv, nqb, nb] uint8: 1 where a key block is selected (columns in it are skipped)
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    num_q_blocks,
    num_blocks,
    first_q_block,
    prefix_len,
    kv_len,
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    COL_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    hq = tl.program_id(0)
    qb = num_q_blocks - 1 - tl.program_id(1)
    h = hq // GROUP
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    start = (first_q_block + qb) * BLOCK  # absolute position of the block's first row
    pos = start + rows
    row_ok = (pos >= prefix_len) & (pos < kv_len)
    q_row = (pos - prefix_len).to(tl.int64)
    q = tl.load(
        Q + q_row[:, None] * stride_qn + hq * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D_PAD], tl.float32)

    row = h * num_q_blocks + qb
    lo = tl.load(block_indptr + row)
    hi = tl.load(block_indptr + row + 1)
    for j in range(lo, hi):
        kb = tl.load(block_indices + j)
        keys = kb * BLOCK + rows
        key_ok = keys < kv_len
        ld = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + keys.to(tl.int64)[:, None] * stride_kn + h * stride_kh + dims[None, :], mask=ld, other=0.0)
        v = tl.load(V + keys.to(tl.int64)[:, None] * stride_vn + h * stride_vh + dims[None, :], mask=ld, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where((keys[None, :] <= pos[:, None]) & key_ok[None, :], s, float("-inf"))
        # every row sees key `start` of its diagonal block, so m_new is finite once that block ran;
        # blocks before it are fully visible: no row's max is -inf at any step
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    c_lo = tl.load(col_indptr + h)
    c_hi = tl.load(col_end + row)  # later columns are causally invisible to the whole block
    offs = tl.arange(0, COL_CHUNK)
    for c0 in range(c_lo, c_hi, COL_CHUNK):
        idx = c0 + offs
        inside = idx < c_hi
        col = tl.load(col_indices + idx, mask=inside, other=0)
        held = tl.load(member + row * num_blocks + col // BLOCK, mask=inside, other=1)
        ok = inside & (col < start) & (held == 0)
        ld = ok[:, None] & dim_ok[None, :]
        k = tl.load(K + col.to(tl.int64)[:, None] * stride_kn + h * stride_kh + dims[None, :], mask=ld, other=0.0)
        v = tl.load(V + col.to(tl.int64)[:, None] * stride_vn + h * stride_vh + dims[None, :], mask=ld, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        Out + q_row[:, None] * stride_on + hq * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@dataclass(slots=True)
class KernelPlan:
    """A mask's index tensors on the kernel's device (built once per layer and sequence)."""

    block_indptr: torch.Tensor
    block_indices: torch.Tensor
    col_indptr: torch.Tensor
    col_end: torch.Tensor
    col_indices: torch.Tensor
    member: torch.Tensor
    num_q_blocks: int
    num_blocks: int
    first_q_block: int
    prefix_len: int
    kv_len: int
    block_size: int


def prepare(mask, device) -> KernelPlan:
    """Host mask (a ``SeqMask``) -> device tensors. Full heads are spelled out as every causal block
    (the kernel walks lists)."""
    mask = mask.spelled_out()
    H, nqb, nb, B = mask.num_heads, mask.num_q_blocks, mask.num_blocks, mask.block_size
    starts = (torch.arange(nqb) + mask.first_q_block) * B
    col_end = torch.cat([mask.col_indptr[h] + torch.searchsorted(mask.cols(h), starts) for h in range(H)])
    parts = [mask.block_indptr, mask.block_indices, mask.col_indptr, col_end, mask.col_indices]
    # one upload (a few small copies each cost a launch and a sync); member is built on the device
    dev = torch.cat(parts).to(torch.int32).to(device, non_blocking=True).split([len(x) for x in parts])
    rows = torch.repeat_interleave(
        torch.arange(H * nqb, device=device), dev[0].diff(), output_size=len(mask.block_indices)
    )
    member = torch.zeros(H * nqb * nb, dtype=torch.uint8, device=device)
    member[rows * nb + dev[1]] = 1
    return KernelPlan(*dev, member, nqb, nb, mask.first_q_block, mask.prefix_len, mask.kv_len, B)


def block_sparse_attention(
    q, k, v, mask, scale: float, col_chunk: int | None = None, plan: KernelPlan | None = None, out=None
) -> torch.Tensor:
    """Same contract as :func:`sgl_loopkv.attention.sparse.torch.sparse_attention` (full heads
    are run as every causal block). q [n, Hq, D]; k, v [L, Hkv, D] -> [n, Hq, D]. ``plan``: a
    :func:`prepare` of ``mask`` (else built here); ``out``: written in place when given;
    ``col_chunk``: columns per step (default the block size: one full-size dot per step)."""
    n, Hq, D = q.shape
    L, H, _ = k.shape
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    plan = plan or prepare(mask, q.device)
    assert (plan.kv_len, plan.kv_len - plan.prefix_len) == (L, n), "mask does not match q/k"
    B = plan.block_size
    if q.device.type == "cuda":
        assert B >= 16 and B & (B - 1) == 0, f"block size {B}: the GPU kernel needs a power of two >= 16"
    out = q.new_empty(n, Hq, D) if out is None else out
    _block_sparse_attn_kernel[(Hq, plan.num_q_blocks)](
        q, k, v, out,
        plan.block_indptr, plan.block_indices, plan.col_indptr, plan.col_end, plan.col_indices, plan.member,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        plan.num_q_blocks, plan.num_blocks, plan.first_q_block, plan.prefix_len, L, scale * _LOG2E,
        GROUP=Hq // H, BLOCK=B, HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)), COL_CHUNK=col_chunk or max(16, B),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if B >= 64 else 2,
    )  # fmt: skip
    return out
