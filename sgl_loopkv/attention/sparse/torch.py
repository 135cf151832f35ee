"""The ``torch`` sparse executor, the CPU path (:func:`sparse_attention`): per (KV head, query
block) the selected keys are gathered once and run through torch's CPU flash-attention kernel, many items per call. How it
was chosen (one-off measurements, SmolLM2 shapes at 8K tokens, one thread; the benchmark's own
numbers are in benchmarks/results/prefill.md):
- torch's CPU flash kernel costs ~2.3-2.5 ns per (row, key) cell, dense causal or on gathered
  keys; a plain bmm + softmax + bmm costs ~6 ns per cell, so every path here ends in that kernel.
  A [items, 1, 1, keys] padding mask broadcast over rows adds ~5%; a materialized per-row mask
  ~20% (why the causal diagonal block is a call of its own, merged by log-sum-exp);
- ``flex_attention`` compiled for CPU (inductor C++ template, block mask): ~17 s of compilation
  per new shape, then 155 ms for a streaming mask of 8% density where dense causal attention
  took 267 ms; recompiling for every prompt length rules it out for serving anyway;
- the previous gather executor (items grouped by exact block count, columns as a separate call
  with a broadcast key set) spent ~1.7-2.1x the dense cost per attended cell; this one spends
  ~1.2-1.3x (gathers of K/V ~10%, the diagonal call and the layout copies the rest), e.g. 2.3x
  faster than dense at 18% density, 3.3x at 8% (selection included).
"""

from __future__ import annotations

import math

import torch

from sgl_loopkv.attention.executor import attend_with_lse as _attend
from sgl_loopkv.attention.executor import dense_attention
from sgl_loopkv.attention.sparse.base import SparseExecutor
from sgl_loopkv.attention.sparse_plan import SeqMask


class TorchSparseExecutor(SparseExecutor):
    """Gather-based block-sparse attention with torch ops (:func:`sparse_attention`), one sequence
    at a time; sequences without a mask go to the backend's dense executor."""

    def attend(self, q, k, v, mask, scale):
        return sparse_attention(q, k, v, mask, scale)


# Gathered keys + values per call stay under this many bytes (items are processed in chunks):
# small enough that the allocator reuses freed buffers instead of page-faulting fresh ones in.
_CHUNK_BYTES = 16 << 20
# Off-diagonal key lists are padded to a multiple of this many keys (masked), so that items of
# similar length share one kernel call; the padding costs < PAD / 2 keys per item on average.
_PAD = 64


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SeqMask, scale: float) -> torch.Tensor:
    """Attention of ``n`` new rows over ``L`` keys restricted to ``mask``.

    q: [n, Hq, D]; k, v: [L, Hkv, D] (the sequence's keys in position order) -> [n, Hq, Dv].

    Work items are (sparse KV head, query block), the head's GQA group stacked into the rows (all
    rows of an item share one key set). Each item is split in two exact parts, merged by
    log-sum-exp:
    - the diagonal block: one causal flash-attention call for every item at once (GQA);
    - everything before it (selected blocks and columns, each key once): the item's key list is
      gathered once; items sorted by list length, padded to a multiple of ``_PAD`` keys, run as
      batched flash-attention calls with a [items, 1, 1, keys] padding mask broadcast over rows.
    So every selected (row, key) cell is computed once by torch's CPU flash kernel, and nothing
    else is, up to the padding. Full heads run :func:`dense_attention`.
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
    front = mask.prefix_len - qb0 * B  # cached-prefix rows before the first new row of the first block
    # q padded to whole blocks, item-major: [Hs * nqb, G, B, D] (pad rows are computed and dropped)
    qp = q.new_zeros(nqb * B, Hq, D) if front or n != nqb * B else None
    if qp is not None:
        qp[front : front + n] = q
    qi = (q if qp is None else qp).view(nqb, B, H, G, D)[:, :, hs].permute(2, 0, 3, 1, 4).reshape(Hs * nqb, G, B, D)
    kt, vt = _head_major(k, hs, nb * B), _head_major(v, hs, nb * B)  # [Hs, nb * B, D], zero past L

    # 1. diagonal blocks, causal (key block qb0 + j is query block j's own positions)
    diag = lambda x: x[:, qb0 * B :].reshape(Hs * nqb, 1, B, -1)  # noqa: E731
    o, lse = _attend(qi, diag(kt), diag(vt), scale, causal=True)  # [items, G, B, Dv], [items, G, B]

    # 2. keys before the diagonal block: per item, its selected earlier blocks, then its columns
    # that lie before the block and in no selected block (each key once; order is irrelevant)
    table = mask.block_table()[hs]  # [Hs, nqb, nb]
    table[:, torch.arange(nqb), torch.arange(nqb) + qb0] = False  # the diagonal is part 1
    table = table.view(Hs * nqb, nb)
    blk_item, blk = table.nonzero(as_tuple=True)  # item-major, ascending
    nblk = table.sum(-1, dtype=torch.int64)
    blk_flat = blk + blk_item // nqb * nb  # block row of the head-major [Hs * nb, B, D] view
    col_count, col_parts = torch.zeros(Hs * nqb, dtype=torch.int64), []
    for j, h in enumerate(sparse):
        c = mask.cols(h)
        if len(c):
            start = (torch.arange(nqb) + qb0) * B
            ok = (c[None, :] < start[:, None]) & ~table[j * nqb : (j + 1) * nqb].gather(1, (c // B).expand(nqb, -1))
            item, which = ok.nonzero(as_tuple=True)
            col_count[j * nqb : (j + 1) * nqb] = ok.sum(-1, dtype=torch.int64)
            col_parts.append(c[which] + j * nb * B)
    # one trailing sentinel each: torch.where below evaluates both sides for every slot
    col_flat = torch.cat([*col_parts, torch.zeros(1, dtype=torch.int64)])
    blk_flat = torch.cat([blk_flat, torch.zeros(1, dtype=torch.int64)])
    blk_off, col_off = nblk.cumsum(0) - nblk, col_count.cumsum(0) - col_count
    counts = nblk * B + col_count
    order = torch.sort(counts, stable=True).indices
    order = order[counts[order] > 0]
    if len(order):
        kf, vf = kt.view(-1, D), vt.view(-1, Dv)
        po = q.new_empty(len(order), G, B, Dv)  # in `order`
        pl = lse.new_empty(len(order), G, B)
        padded = (counts[order] + _PAD - 1) // _PAD * _PAD
        i0 = 0
        for width, size in zip(*(x.tolist() for x in torch.unique_consecutive(padded, return_counts=True))):
            step = max(1, _CHUNK_BYTES // (width * (D + Dv) * q.element_size()))
            for c0 in range(i0, i0 + size, step):
                c1 = min(i0 + size, c0 + step)
                items = order[c0:c1]
                m, cnt, nk = c1 - c0, counts[items, None], nblk[items, None] * B
                slot = torch.arange(width)[None, :]
                at = torch.minimum(slot, cnt - 1)  # padding repeats the last key (masked below)
                idx = torch.where(
                    at < nk,
                    blk_flat[(blk_off[items, None] + at // B).clamp(max=len(blk_flat) - 1)] * B + at % B,
                    col_flat[(col_off[items, None] + at - nk).clamp(min=0, max=len(col_flat) - 1)],
                ).view(-1)
                pad = torch.zeros(m, 1, 1, width, dtype=q.dtype).masked_fill_(
                    (slot >= cnt).view(m, 1, 1, width), -math.inf
                )
                part_o, part_lse = _attend(
                    qi.index_select(0, items).view(m, 1, G * B, D),
                    kf.index_select(0, idx).view(m, 1, width, D),
                    vf.index_select(0, idx).view(m, 1, width, Dv),
                    scale,
                    pad,
                )
                po[c0:c1] = part_o.view(m, G, B, Dv)
                pl[c0:c1] = part_lse.view(m, G, B)
            i0 += size
        # softmax over both key sets: o + (o_c - o) * w_c / (w + w_c), w_c / (w + w_c) = sigmoid(lse_c - lse)
        od, ld = o.index_select(0, order), lse.index_select(0, order)
        od.lerp_(po, torch.sigmoid(pl - ld)[..., None])
        o.index_copy_(0, order, od)

    o = o.view(Hs, nqb, G, B, Dv).permute(1, 3, 0, 2, 4).reshape(nqb * B, Hs, G, Dv)[front : front + n]
    if Hs == H:
        out.view(n, H, G, Dv).copy_(o)
    else:
        out.view(n, H, G, Dv)[:, hs] = o
    return out


def _head_major(x: torch.Tensor, heads: torch.Tensor, length: int) -> torch.Tensor:
    """[L, H, D] -> [len(heads), length, D] (positions past L are zero)."""
    L, H, D = x.shape
    out = x.new_empty(len(heads), length, D)
    out[:, :L] = x.transpose(0, 1) if len(heads) == H else x[:, heads].transpose(0, 1)
    out[:, L:].zero_()
    return out
