"""Sparse paged decode in Triton: one query row per sequence, a key list per (sequence, KV head).

Contract (the same as :func:`sgl_loopkv.attention.decode_gpu.sparse_decode_reference`)::

    q, out       [B, Hq, D]        one query row per sequence; fp32, bf16 or fp16 (out: any float)
    k/v_cache    [P, Hkv, D]       one layer's pool buffers (q's dtype), read in place
    head_indptr  [B * Hkv + 1]     int64; entry b * Hkv + h spans the keys KV head h of sequence b reads
    head_slots   [head_indptr[-1]] int64 pool slots of those keys (any order; lists may differ in length)
    out[b, qh] = softmax(q[b, qh] . K_sel^T * scale) V_sel, qh in h*g .. (h+1)*g - 1, g = Hq // Hkv

fp32 softmax and accumulation; an empty list gives zeros. Keys are read through the slot list
(no gather into a copy), each key/value row once for the whole GQA group of its KV head.

Work split (flash-decoding): program (row, split) walks split ``s`` of the row's list, the list cut
into ``num_splits`` equal parts rounded up to whole blocks (so a single long sequence still fills
the GPU), with an online softmax (base 2, ``scale * log2(e)`` folded into q). With one split the
program writes ``out``; with several it writes a normalised partial output and its log-sum-exp,
and a second kernel merges a row's splits (one program per row, splits in order). ``num_splits``
by default comes from the shapes alone (rows and total keys: no host sync): enough programs for
twice the SMs, at least :data:`MIN_KEYS_PER_SPLIT` keys per split on average.

Products: fp16/bf16 K/V go unconverted into ``tl.dot`` on tensor cores (the default,
``tensor_cores``): the group padded to 16 rows (decode is memory-bound, so the padding costs
nothing measurable), fp32 accumulation, scores scaled after the dot, p rounded to the half type for
the PV product as FlashInfer does. Otherwise (fp32, or ``tensor_cores=False``) the g x D by D x
BLOCK products are broadcast-multiply-sum in fp32 for small groups and ``tl.dot`` (IEEE fp32; tf32
for half inputs) from 16. The fp32-product path converts every K/V row and keeps blocks of 16-32
keys to bound registers: 3x slower on an H200 (``benchmarks/gpu_decode.py``). Tested on CPU under
``TRITON_INTERPRET=1`` (tests/e2e/test_triton_interpreter.py: fp32, and fp16 on the tensor-core
path; the 3.8 interpreter's bf16 dots are wrong) and, when a GPU is present,
tests/unit/test_sparse_decode_gpu.py (both paths, fp16 and bf16).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write, merge) dominates
# fp16/bf16 through tensor cores by default: on an H200 (benchmarks/results/gpu_decode.md) 1.5-7x
# faster than the fp32 products over the same lists (median 3x), errors 2.3e-3 vs 1.7e-3 relative
TENSOR_CORES_DEFAULT = True
_PRODUCT_ELEMS = 8192  # g_pad * BLOCK * d_pad of the broadcast products: ~64 fp32 registers a thread


@triton.jit
def _sparse_decode_kernel(
    Q,
    K,
    V,
    Out,
    PartO,  # [rows, num_splits, G_PAD, D_PAD] fp32 (only with SPLIT)
    PartLse,  # [rows, num_splits, G_PAD] fp32, base 2
    head_indptr,
    head_slots,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    num_kv_heads,
    num_splits,
    qk_scale,  # scale * log2(e)
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    TC: tl.constexpr,  # half inputs straight into tensor-core dots (G padded to 16), scores scaled in fp32
):
    r = tl.program_id(0)  # row = b * num_kv_heads + h
    s = tl.program_id(1)
    b = r // num_kv_heads
    h = r % num_kv_heads
    lo = tl.load(head_indptr + r)
    hi = tl.load(head_indptr + r + 1)
    per = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK) * BLOCK
    start = lo + s * per
    end = tl.minimum(start + per, hi)  # < start for a split past the list: no iteration

    gi = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    g_ok = gi < GROUP
    d_ok = dims < HEAD_DIM
    qh = h * GROUP + gi
    q = tl.load(
        Q + b * stride_qb + qh[:, None] * stride_qh + dims[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )
    if not TC:
        q = q.to(tl.float32) * qk_scale
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)

    offs = tl.arange(0, BLOCK)
    for k0 in range(start, end, BLOCK):
        idx = k0 + offs
        ok = idx < end
        slot = tl.load(head_slots + idx, mask=ok, other=0).to(tl.int64)
        ld = ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_kn + h * stride_kh + dims[None, :], mask=ld, other=0.0)
        v = tl.load(V + slot[:, None] * stride_vn + h * stride_vh + dims[None, :], mask=ld, other=0.0)
        if TC:
            sc = tl.dot(q, tl.trans(k)) * qk_scale  # fp32 accumulation of exact half products
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if USE_DOT:
                sc = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            else:
                sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK]
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: every block holds a listed key
        p = tl.math.exp2(sc - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TC:
            pv = tl.dot(p.to(v.dtype), v)  # p rounded to the pool's half type, as FlashInfer does
        elif USE_DOT:
            pv = tl.dot(p, v, input_precision=PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G_PAD, D_PAD]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty list or split: zeros
    if SPLIT:
        part = (r * num_splits + s).to(tl.int64) * G_PAD + gi
        tl.store(PartO + part[:, None] * D_PAD + dims[None, :], o)
        tl.store(PartLse + part, tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf")))
    else:
        tl.store(
            Out + b * stride_ob + qh[:, None] * stride_oh + dims[None, :],
            o.to(Out.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    PartO,
    PartLse,
    Out,
    stride_ob,
    stride_oh,
    num_kv_heads,
    num_splits,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    r = tl.program_id(0)
    b = r // num_kv_heads
    h = r % num_kv_heads
    gi = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for s in range(0, num_splits):
        part = (r * num_splits + s).to(tl.int64) * G_PAD + gi
        lse = tl.load(PartLse + part)
        o = tl.load(PartO + part[:, None] * D_PAD + dims[None, :])
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with keys yet: weights 0
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    qh = h * GROUP + gi
    tl.store(
        Out + b * stride_ob + qh[:, None] * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=(gi < GROUP)[:, None] & (dims < HEAD_DIM)[None, :],
    )


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(rows: int, total_keys: int, programs: int) -> int:
    """Splits per row so that ``rows * splits`` reaches ``programs`` without splits shorter than
    :data:`MIN_KEYS_PER_SPLIT` keys on average (shapes only: no host sync)."""
    want = -(-programs // max(rows, 1))
    return max(1, min(want, total_keys // max(rows, 1) // MIN_KEYS_PER_SPLIT))


def sparse_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """See the module docstring for the contract; returns ``out`` (written in place). q, out, and
    the pool need unit stride in the last dim (rows and heads may be strided views).
    ``num_splits``: splits per (sequence, KV head) (default: :func:`default_num_splits`).
    ``tensor_cores``: fp16/bf16 K/V go into ``tl.dot`` unconverted (the group padded to 16 rows,
    p rounded to the half type for the PV product); None = :data:`TENSOR_CORES_DEFAULT`; ignored
    for fp32."""
    B, Hq, D = q.shape
    H = k_cache.shape[1]
    assert Hq % H == 0, f"{Hq} query heads are no multiple of {H} KV heads"
    assert head_indptr.numel() == B * H + 1, "head_indptr must have B * Hkv + 1 entries"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == out.stride(-1) == 1, "unit last stride"
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q is {q.dtype}, the pool {k_cache.dtype}/{v_cache.dtype}")
    head_indptr = head_indptr.to(q.device, non_blocking=True)
    head_slots = head_slots.to(q.device, non_blocking=True)
    G, rows = Hq // H, B * H
    if rows == 0:
        return out
    tc = (TENSOR_CORES_DEFAULT if tensor_cores is None else tensor_cores) and q.dtype != torch.float32
    g_pad = max(16 if tc else 2, triton.next_power_of_2(G))
    d_pad = max(16, triton.next_power_of_2(D))
    use_dot = g_pad >= 16
    block = 64 if use_dot else max(16, min(64, _PRODUCT_ELEMS // (g_pad * d_pad)))
    if num_splits is None:
        programs = 2 * _sm_count(q.device.index or 0) if q.is_cuda else 1
        num_splits = default_num_splits(rows, head_slots.numel(), programs)
    split = num_splits > 1
    part_o = part_lse = out  # placeholders when unsplit (the kernel does not touch them)
    if split:
        part_o = torch.empty(rows, num_splits, g_pad, d_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, num_splits, g_pad, dtype=torch.float32, device=q.device)
    consts = dict(GROUP=G, G_PAD=g_pad, HEAD_DIM=D, D_PAD=d_pad)
    _sparse_decode_kernel[(rows, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, head_indptr, head_slots,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), H, num_splits, scale * _LOG2E,
        **consts, BLOCK=block, SPLIT=split, USE_DOT=use_dot,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TC=tc,
        num_warps=4,
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(rows,)](
            part_o, part_lse, out, out.stride(0), out.stride(1), H, num_splits, **consts, num_warps=2
        )
    return out
