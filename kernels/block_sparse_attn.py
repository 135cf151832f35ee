"""Block-sparse prefill attention in Triton, driven by a :class:`~sgl_loopkv.attention.sparse_plan.SeqMask`.

One program per (query block, query head): it walks the CSR list of its KV head's selected key
blocks (a causal mask only bites in the diagonal block), then the head's columns in chunks (each
skipped when a selected block already holds it, or when it is not before the query block), with
an online softmax, FlashAttention style. Only the listed work is done, like LServe's iterator.

Tested on CPU with ``TRITON_INTERPRET=1`` on small sizes (tests/test_sparse_kernels.py); on a GPU
the same kernel compiles (block size and head dim must then be powers of two >= 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_sparse_attn_kernel(
    Q,
    K,
    V,
    Out,  # Q/Out [rows, Hq, D] padded to whole query blocks; K/V [nb * B, Hkv, D]
    block_indptr,
    block_indices,
    col_indptr,
    col_indices,
    member,  # member: [Hkv, nqb, nb] uint8
    stride_q,
    stride_qh,
    stride_k,
    stride_kh,
    num_q_blocks,
    num_blocks,
    first_q_block,
    kv_len,
    scale,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COL_CHUNK: tl.constexpr,
):
    qb = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GROUP
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    start = (first_q_block + qb) * BLOCK  # absolute position of the block's first row
    pos = start + rows
    q = tl.load(Q + (qb * BLOCK + rows)[:, None] * stride_q + hq * stride_qh + dims[None, :])
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)

    row = h * num_q_blocks + qb
    lo = tl.load(block_indptr + row)
    hi = tl.load(block_indptr + row + 1)
    for j in range(lo, hi):
        kb = tl.load(block_indices + j)
        keys = kb * BLOCK + rows
        kv_off = keys[:, None] * stride_k + h * stride_kh + dims[None, :]
        k = tl.load(K + kv_off)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where((keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_len), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), tl.load(V + kv_off).to(tl.float32))
        m_i = m_new

    c_lo = tl.load(col_indptr + h)
    c_hi = tl.load(col_indptr + h + 1)
    offs = tl.arange(0, COL_CHUNK)
    for c0 in range(c_lo, c_hi, COL_CHUNK):
        idx = c0 + offs
        inside = idx < c_hi
        col = tl.load(col_indices + idx, mask=inside, other=0)
        held = tl.load(member + row * num_blocks + col // BLOCK, mask=inside, other=1)
        ok = inside & (col < start) & (held == 0)
        kv_off = col[:, None] * stride_k + h * stride_kh + dims[None, :]
        k = tl.load(K + kv_off, mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32))
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(Out + (qb * BLOCK + rows)[:, None] * stride_q + hq * stride_qh + dims[None, :], out)


def block_sparse_attention(q, k, v, mask, scale: float, col_chunk: int = 16) -> torch.Tensor:
    """Same contract as :func:`sgl_loopkv.attention.sparse_executor.sparse_attention` (full heads
    are run as every causal block). q [n, Hq, D]; k, v [L, Hkv, D] -> [n, Hq, D]."""
    n, Hq, D = q.shape
    L, H, _ = k.shape
    B, qb0, nqb, nb = mask.block_size, mask.first_q_block, mask.num_q_blocks, mask.num_blocks
    if any(mask.full):  # the kernel walks lists: spell full heads out as every causal block
        from sgl_loopkv.attention.sparse_plan import SeqMask

        table = mask.block_table()
        table[torch.tensor(mask.full)] = True
        cols = [mask.cols(h) for h in range(H)]
        mask = SeqMask.from_block_table(table, L, n, B, cols)
    front = mask.prefix_len - qb0 * B
    dev = q.device
    qp = q.new_zeros(nqb * B, Hq, D)
    qp[front : front + n] = q
    kp, vp = k.new_zeros(nb * B, H, D), v.new_zeros(nb * B, H, D)
    kp[:L], vp[:L] = k, v
    out = torch.empty_like(qp)
    i32 = lambda t: t.to(device=dev, dtype=torch.int32).contiguous()  # noqa: E731
    member = mask.block_table().to(device=dev, dtype=torch.uint8).contiguous()
    _block_sparse_attn_kernel[(nqb, Hq)](
        qp, kp, vp, out,
        i32(mask.block_indptr), i32(mask.block_indices), i32(mask.col_indptr), i32(mask.col_indices), member,
        qp.stride(0), qp.stride(1), kp.stride(0), kp.stride(1),
        nqb, nb, qb0, L, scale,
        GROUP=Hq // H, BLOCK=B, HEAD_DIM=D, COL_CHUNK=col_chunk,
    )  # fmt: skip
    return out[front : front + n]
