"""Sparse executors: run a :class:`SparsePlan` exactly. One interface, chosen by name.

``torch`` is the CPU path: the selected key blocks of each (query block, KV head) are gathered and
run through torch's CPU flash-attention kernel, many query blocks per call. How it was chosen
(one-off measurements while building it, 8K tokens, SmolLM2 shapes, 2 cores; the benchmark's own
numbers are in benchmarks/results/prefill.md):
- ``flex_attention`` compiled for CPU (inductor C++ template, block mask): ~17 s of compilation per
  new shape, then 155 ms for a streaming mask of 8% density where dense causal attention took
  267 ms; recompiling for every prompt length rules it out for serving anyway;
- boolean-mask SDPA: ~2x slower than the same call with an additive float mask;
- gather + flash (this file): at 14-42% density it costs ~1.7-2.1x the dense kernel per attended
  cell (gathers, more and smaller kernel calls), i.e. 3.2x faster than dense at 14% density and
  1.4x at 42%.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from sgl_loopkv.attention.executor import EXECUTORS, AttentionExecutor, dense_attention
from sgl_loopkv.attention.plan import AttentionPlan
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan
from sgl_loopkv.registry import Registry


class SparseExecutor(ABC):
    """Computes, for every sequence of a :class:`SparsePlan`, softmax attention of its new rows
    over exactly the keys its mask lists (dense causal attention where the mask is None).

    Shapes as in :class:`~sgl_loopkv.attention.executor.AttentionExecutor`: ``q``/``out``
    [num_q_tokens, num_q_heads, head_dim], ``k_cache``/``v_cache`` [pool_slots, num_kv_heads,
    head_dim]; query head ``h`` uses KV head ``h // (num_q_heads // num_kv_heads)``.
    """

    @abstractmethod
    def run(
        self,
        plan: SparsePlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor: ...


SPARSE_EXECUTORS: Registry[SparseExecutor] = Registry("sparse attention executor")


def one_sequence(base: AttentionPlan, i: int) -> AttentionPlan:
    """Sequence ``i`` of a dense plan as a plan of its own (its q rows start at 0)."""
    return AttentionPlan([0, base.q_len(i)], [0, base.kv_len(i)], base.kv_slots(i), base.causal, [base.runs(i)])


def run_dense(dense: AttentionExecutor, base: AttentionPlan, i: int, q, k_cache, v_cache, scale, out) -> None:
    """Sequence ``i`` exactly as the dense executor computes it (a sequence the policy left dense
    gets the dense backend's numbers even inside a sparse batch)."""
    q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
    dense.run(one_sequence(base, i), q[q0:q1], k_cache, v_cache, scale, out[q0:q1])


@SPARSE_EXECUTORS.register("torch")
class TorchSparseExecutor(SparseExecutor):
    """Gather-based block-sparse attention with torch ops, one sequence at a time; sequences without
    a mask go to ``dense`` (the backend's dense executor)."""

    def __init__(self, dense: AttentionExecutor | None = None):
        self.dense = dense or EXECUTORS.create("torch")

    def run(self, plan, q, k_cache, v_cache, scale, out):
        base = plan.base
        for i, mask in enumerate(plan.masks):
            q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
            if q0 == q1:
                continue
            if mask is None:
                run_dense(self.dense, base, i, q, k_cache, v_cache, scale, out)
            else:
                out[q0:q1] = sparse_attention(q[q0:q1], base.kv_of(i, k_cache), base.kv_of(i, v_cache), mask, scale)
        return out


# Gathered keys + values per call stay under this many bytes (q blocks are processed in chunks):
# small enough that the allocator reuses freed buffers instead of page-faulting fresh ones in.
_CHUNK_BYTES = 16 << 20


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SeqMask, scale: float) -> torch.Tensor:
    """Attention of ``n`` new rows over ``L`` keys restricted to ``mask``.

    q: [n, Hq, D]; k, v: [L, Hkv, D] (the sequence's keys in position order) -> [n, Hq, Dv].

    Work items are (query block, sparse head) with the head's GQA group folded into the rows,
    sorted by (head, number of selected blocks). Items with the same count run as one batched
    flash-attention call over their gathered key blocks: no padding, and since each item's
    diagonal block comes last, one additive mask [rows, keys] (zeros, then the causal triangle)
    serves the whole call. A head's columns (keys shared by all its blocks) are one more call per
    chunk of its items, merged by log-sum-exp. Full heads run :func:`dense_attention`.
    """
    n, Hq, D = q.shape
    L, H, Dv = v.shape
    G = Hq // H
    assert (mask.q_len, mask.kv_len, mask.num_heads) == (n, L, H), "mask does not match q/k"
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = q.new_empty(n, Hq, Dv)
    full = [h for h in range(H) if mask.full[h]]
    sparse = [h for h in range(H) if not mask.full[h]]
    if full:
        qh = torch.tensor([h * G + g for h in full for g in range(G)])
        out[:, qh] = dense_attention(q[:, qh], k[:, full], v[:, full], scale)
    if not sparse:
        return out

    B, qb0, nqb, nb = mask.block_size, mask.first_q_block, mask.num_q_blocks, mask.num_blocks
    Hs, hs = len(sparse), torch.tensor(sparse)
    R = B * G  # rows of an item: row r of the block, group member g at r * G + g
    front = mask.prefix_len - qb0 * B  # cached-prefix rows before the first new row of the first block
    aligned = front == 0 and n == nqb * B
    if aligned:
        qp = q
    else:  # pad to whole blocks (pad rows are computed and dropped)
        qp = q.new_empty(nqb * B, Hq, D)
        qp[:front].zero_()
        qp[front + n :].zero_()
        qp[front : front + n] = q
    # head-major copies (item id = j * nqb + query block): gathers below are index_select on rows,
    # far faster on CPU than multi-dimensional fancy indexing
    qh = qp.view(nqb, B, H, G, D).permute(2, 0, 1, 3, 4)
    qh = (qh if Hs == H else qh[hs]).reshape(Hs * nqb, R * D)
    kb, vb = _as_blocks(k, hs, nb, B), _as_blocks(v, hs, nb, B)  # [Hs * nb, B * D], row = j * nb + block

    item_j, item_qb = torch.arange(Hs).repeat_interleave(nqb), torch.arange(nqb).repeat(Hs)
    csr_row = item_qb + hs[item_j] * nqb
    starts = mask.block_indptr[csr_row]
    counts = mask.block_indptr[csr_row + 1] - starts
    key = item_j * (nb + 1) + counts
    perm = torch.sort(key, stable=True).indices  # by (head, block count): each group is a contiguous range
    identity = bool((perm == torch.arange(len(perm))).all())  # e.g. streaming heads: counts grow with the block
    if not identity:
        item_j, item_qb, starts, counts, key = item_j[perm], item_qb[perm], starts[perm], counts[perm], key[perm]
    qs = (qh if identity else qh.index_select(0, perm)).view(-1, R, D)
    os = q.new_empty(Hs * nqb, R, Dv)
    lse = q.new_empty(Hs * nqb, R)
    tri = torch.ones(B, B, dtype=torch.bool).triu(1).repeat_interleave(G, 0)  # [R, B]: key after the row
    sizes = torch.unique_consecutive(key, return_counts=True)[1]
    bounds = [0, *torch.cumsum(sizes, 0).tolist()]
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        count = int(counts[s0])
        mask_add = torch.zeros(R, count * B, dtype=q.dtype)
        mask_add[:, -B:].masked_fill_(tri, -math.inf)
        step = max(1, _CHUNK_BYTES // (count * B * (D + Dv) * q.element_size()))
        for c0 in range(s0, s1, step):
            c1 = min(s1, c0 + step)
            blocks = mask.block_indices[starts[c0:c1, None] + torch.arange(count)]  # [m, count], diagonal last
            flat = (blocks + item_j[c0:c1, None] * nb).reshape(-1)
            part_o, part_lse = _attend(
                qs[c0:c1].view(c1 - c0, 1, R, D),
                kb.index_select(0, flat).view(c1 - c0, 1, count * B, D),
                vb.index_select(0, flat).view(c1 - c0, 1, count * B, Dv),
                scale,
                mask_add.view(1, 1, R, -1),
            )
            os[c0:c1] = part_o.view(c1 - c0, R, Dv)
            lse[c0:c1] = part_lse.view(c1 - c0, R)
    if mask.col_indices.numel():
        _add_columns(mask, hs, item_qb, item_j, qs, kb, vb, os, lse, scale)

    if not identity:
        os = torch.empty_like(os).index_copy_(0, perm, os)
    o = os.view(Hs, nqb * B, G, Dv)[:, front : front + n].permute(1, 0, 2, 3)  # [n, Hs, G, Dv]
    if Hs == H:
        out.view(n, H, G, Dv).copy_(o)
    else:
        out.view(n, H, G, Dv)[:, hs] = o
    return out


def _as_blocks(x: torch.Tensor, heads: torch.Tensor, nb: int, B: int) -> torch.Tensor:
    """[L, H, D] -> [len(heads) * nb, B * D] (row = head index * nb + block), zero past L."""
    L, H, D = x.shape
    out = x.new_empty(len(heads), nb * B, D)
    out[:, :L] = x.transpose(0, 1) if len(heads) == H else x[:, heads].transpose(0, 1)
    out[:, L:].zero_()
    return out.view(len(heads) * nb, B * D)


def _add_columns(mask: SeqMask, hs, item_qb, item_j, qs, kb, vb, os, lse, scale) -> None:
    """Merge each head's columns into its items' partial results (os, lse), in place. An item
    counts a column when it lies before the item's block and no selected block holds it."""
    B, qb0 = mask.block_size, mask.first_q_block
    R, D, Dv = qs.shape[1], qs.shape[2], os.shape[2]
    table = mask.block_table()
    kt, vt = kb.view(len(hs), -1, D), vb.view(len(hs), -1, Dv)  # [Hs, positions, D]
    for j, h in enumerate(hs.tolist()):
        cols = mask.cols(h)
        if not len(cols):
            continue
        kc, vc = kt[j, cols], vt[j, cols]  # [C, D]
        lo, hi = (int(x) for x in torch.searchsorted(item_j, torch.tensor([j, j + 1])))
        step = max(1, _CHUNK_BYTES // (len(cols) * R * 4))  # bounds the [items, rows, columns] scores
        for c0 in range(lo, hi, step):
            c1 = min(hi, c0 + step)
            qb = item_qb[c0:c1]
            block_start = (qb + qb0) * B
            width = int(torch.searchsorted(cols, block_start.max()))  # later columns count nowhere here
            if width == 0:
                continue
            c = cols[:width]
            ok = (c[None, :] < block_start[:, None]) & ~table[h][qb[:, None], (c // B)[None, :]]
            if not bool(ok.any()):
                continue
            m = c1 - c0
            part_o, part_lse = _attend(
                qs[c0:c1].view(m, 1, R, D),
                kc[:width].expand(m, 1, width, D),  # shared by the items: a broadcast, no copy
                vc[:width].expand(m, 1, width, Dv),
                scale,
                torch.zeros(ok.shape, dtype=qs.dtype).masked_fill_(~ok, -math.inf).view(m, 1, 1, width),
            )
            part_lse = part_lse.view(m, R).to(lse.dtype).masked_fill(~ok.any(-1, keepdim=True), -math.inf)
            # softmax over both key sets: o + (o_c - o) * w_c / (w + w_c), w_c / (w + w_c) = sigmoid(lse_c - lse)
            os[c0:c1].lerp_(part_o.view(m, R, Dv), torch.sigmoid(part_lse - lse[c0:c1])[..., None])
            lse[c0:c1] = torch.logaddexp(lse[c0:c1], part_lse)


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend(q, k, v, scale, attn_mask=None, causal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of softmax attention. q [b, hq, m, D]; k, v [b, hk, s, D] with hq a multiple
    of hk; ``attn_mask`` additive, broadcastable to [b, hq, m, s]; ``causal``: m == s, row r sees 0..r.

    On CPU this is torch's flash-attention kernel (what SDPA runs), called directly because SDPA
    does not return the log-sum-exp needed to merge partial results; elsewhere a plain reference."""
    if q.device.type == "cpu" and _flash_cpu is not None:
        return _flash_cpu(q, k, v, is_causal=causal, attn_mask=attn_mask, scale=scale)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)).float() * scale
    if attn_mask is not None:
        s = s + attn_mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    lse = s.logsumexp(-1)
    safe = lse.masked_fill(lse == -math.inf, 0.0)  # a row with no key: output 0, like the CPU kernel
    return ((s - safe[..., None]).exp().to(v.dtype) @ v), lse


@SPARSE_EXECUTORS.register("triton")
class TritonSparseExecutor(SparseExecutor):
    """The Triton block-sparse kernel (kernels/block_sparse_attn.py): GPU, or CPU under
    ``TRITON_INTERPRET=1`` (slow: tests only)."""

    def __init__(self, dense: AttentionExecutor | None = None):
        self.dense = dense or EXECUTORS.create("torch")

    def run(self, plan, q, k_cache, v_cache, scale, out):
        from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention

        base = plan.base
        for i, mask in enumerate(plan.masks):
            q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
            if q0 == q1:
                continue
            if mask is None:
                run_dense(self.dense, base, i, q, k_cache, v_cache, scale, out)
            else:
                k, v = base.kv_of(i, k_cache), base.kv_of(i, v_cache)
                out[q0:q1] = block_sparse_attention(q[q0:q1], k, v, mask, scale)
        return out


@SPARSE_EXECUTORS.register("flashinfer")
def _flashinfer_executor(dense: AttentionExecutor | None = None) -> SparseExecutor:
    """FlashInfer's paged prefill kernel (CUDA only; imported on first use)."""
    from sgl_loopkv.attention.flashinfer_executor import FlashInferSparseExecutor

    return FlashInferSparseExecutor(dense)
