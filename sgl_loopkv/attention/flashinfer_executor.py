"""GPU executor: a :class:`SparsePlan` run by FlashInfer's paged prefill kernel (page size 1).

Every (sequence, KV head, query block) becomes one FlashInfer request whose KV "pages" are exactly
the keys its mask lists, ordered [selected earlier blocks, columns no block holds, diagonal
block]. FlashInfer's causal mask aligns a request's last query with its last key, so with the
diagonal block last, every earlier key is visible to all rows and the diagonal block is causal:
the mask's semantics exactly. A full head is one request over all its causal keys.

Heads are folded into the pages, so that one ``plan()`` and one ``run()`` per layer cover every
head of every sparse sequence (mini-sglang style: plan once, run): the pool's [slots, Hkv, D]
buffer is read in place as [slots * Hkv] pages of one token and one KV head (page = slot * Hkv +
head), each request is one KV head (``num_kv_heads=1``) with its GQA group as ``num_qo_heads``,
and q is laid out head-major ([Hkv * n, G, D], one copy). The plan is per layer because online
policies select per layer.

Sequences without a mask run the dense executor. FlashInfer has no fp32 prefill kernels: fp32
batches run the Triton kernel (same plan semantics) instead. Tested on an H100 with flashinfer
0.7.2 (tests/test_sparse_gpu.py, fa3 and fa2); the request layout also on CPU
(tests/test_sparse_kernels.py).

Measured on that H100 (benchmarks/results/gpu_sparse.md): the FlashInfer kernel itself reaches
2.4x dense at 32K tokens and density 0.1, but page lists of one key each are O(attended keys /
block): every vertical column is repeated in every later query block's list, and building them
on the host costs 4-11 ms per layer at 8K and 70-240 ms at 32K, 10-100x the kernel. Use the Triton
executor on GPUs; moving the list expansion onto the device is what this one would need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sgl_loopkv.attention.executor import EXECUTORS, AttentionExecutor
from sgl_loopkv.attention.sparse_executor import SparseExecutor, run_dense
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan


@dataclass(slots=True)
class Requests:
    """One layer's FlashInfer requests. qo_indptr/kv_indptr: host int32 [R + 1]; kv_indices: int32
    pages (slot * num_kv_heads + head) on the pool's device; seqs: (sequence, q0, q1) of every
    masked sequence, in request order (each contributes num_kv_heads * (q1 - q0) query rows,
    head-major)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seqs: list[tuple[int, int, int]]


def sequence_requests(mask: SeqMask):
    """One sequence's requests, on the host (numpy: these are many small array ops). Sparse head:
    one request per query block; full head: one request. Returns (rows per request, keys per
    request, early, rest): the key list of all requests concatenated is given by ``early`` = (at,
    block, head): key block ``block`` of head ``head`` at positions at .. at + B - 1 (the bulk,
    expanded on the device), and ``rest`` = (at, key, head): single keys (columns, diagonal
    blocks, full heads). All int64 arrays."""
    B, L, P, qb0, nqb, nb = (
        mask.block_size,
        mask.kv_len,
        mask.prefix_len,
        mask.first_q_block,
        mask.num_q_blocks,
        mask.num_blocks,
    )
    indptr, indices = mask.block_indptr.numpy(), mask.block_indices.numpy()
    starts = (np.arange(nqb, dtype=np.int64) + qb0) * B
    ends = np.minimum(starts + B, L)
    rows = ends - np.maximum(starts, P)  # new rows per query block
    nd = ends - starts  # keys of the diagonal block
    diag_key = np.arange(nd.sum()) + np.repeat(starts - (np.cumsum(nd) - nd), nd)
    table = np.zeros((mask.num_heads * nqb, nb), dtype=bool)
    table[np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)), indices] = True
    table = table.reshape(mask.num_heads, nqb, nb)
    table[:, np.arange(nqb), np.arange(nqb) + qb0] = False  # the diagonal goes last
    q_rows, counts, early, rest = [], [], [], []
    base = 0  # first key of the head's requests
    for h in range(mask.num_heads):
        if mask.full[h]:
            q_rows.append(np.array([mask.q_len]))
            counts.append(np.array([L]))
            rest.append((base + np.arange(L), np.arange(L), np.full(L, h)))
            base += L
            continue
        off = table[h]  # [nqb, nb] earlier selected blocks
        nblk = off.sum(1)
        c = mask.cols(h).numpy()
        # columns before the block (a prefix: they are sorted) that no selected block holds
        ncand = np.searchsorted(c, starts)
        j_c = np.repeat(np.arange(nqb), ncand)
        w_c = np.arange(len(j_c)) - np.repeat(np.cumsum(ncand) - ncand, ncand)
        keep = ~off[j_c, c[w_c] // B]
        j_c, w_c = j_c[keep], w_c[keep]
        nc = np.bincount(j_c, minlength=nqb)
        cnt = nblk * B + nc + nd
        first = base + np.cumsum(cnt) - cnt  # offset of each request's keys
        j, blk = np.nonzero(off)  # request-major, ascending
        rank = np.arange(len(j)) - (np.cumsum(nblk) - nblk)[j]
        early.append((first[j] + rank * B, blk, np.full(len(j), h)))
        col_at = first[j_c] + nblk[j_c] * B + np.arange(len(j_c)) - np.repeat(np.cumsum(nc) - nc, nc)
        diag_at = np.repeat(first + nblk * B + nc - starts, nd) + diag_key
        rest.append(
            (np.concatenate([col_at, diag_at]), np.concatenate([c[w_c], diag_key]), np.full(len(j_c) + len(diag_at), h))
        )
        q_rows.append(rows)
        counts.append(cnt)
        base += int(cnt.sum())
    return q_rows, counts, early, rest


def build_requests(plan: SparsePlan, num_kv_heads: int, device) -> Requests:
    """The requests of every masked sequence of ``plan`` (pages into a pool of ``num_kv_heads``).
    Index lists are built on the host per (head, query block), uploaded once per sequence, and
    expanded to one page per key on the device."""
    base, H = plan.base, num_kv_heads
    q_rows, counts, seqs, parts = [], [], [], []
    for i, mask in enumerate(plan.masks):
        q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
        if mask is None or q0 == q1:
            continue
        assert mask.num_heads == H, "mask heads != KV heads"
        r, c, early, rest = sequence_requests(mask)
        ne, nr = sum(len(e[0]) for e in early), sum(len(x[0]) for x in rest)
        host = np.concatenate([x[k] for k in range(3) for x in early] + [x[k] for k in range(3) for x in rest])
        parts.append(
            (
                base.kv_slots(i),
                torch.from_numpy(host.astype(np.int64)),
                ne,
                nr,
                mask.block_size,
                int(sum(x.sum() for x in c)),
            )
        )
        q_rows += r
        counts += c
        seqs.append((i, q0, q1))
    kv = torch.empty(sum(p[-1] for p in parts), dtype=torch.int32, device=device)
    offset = 0
    for slots, host, ne, nr, B, total in parts:
        slots = slots.to(device=device, dtype=torch.int64)
        d = host.to(device, non_blocking=True)
        e_at, e_blk, e_h, r_at, r_key, r_h = d.split([ne, ne, ne, nr, nr, nr])
        ar = torch.arange(B, device=device)
        pages = slots[e_blk[:, None] * B + ar] * H + e_h[:, None]  # page = pool slot * H + head
        kv[offset + (e_at[:, None] + ar).view(-1)] = pages.view(-1).to(torch.int32)
        kv[offset + r_at] = (slots[r_key] * H + r_h).to(torch.int32)
        offset += total
    indptr = lambda x: torch.from_numpy(np.concatenate([[0], *x]).cumsum().astype(np.int32))  # noqa: E731
    return Requests(indptr(q_rows), indptr(counts), kv, seqs)


class FlashInferSparseExecutor(SparseExecutor):
    """One FlashInfer plan + run per layer for all sparse sequences and heads (see the module
    docstring). ``backend``: FlashInfer's ("auto" = fa3 on Hopper, else fa2)."""

    def __init__(self, dense: AttentionExecutor | None = None, workspace_bytes: int = 128 << 20, backend="auto"):
        import flashinfer

        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=backend)
        self.dense = dense or EXECUTORS.create("torch")
        self._triton = None

    def run(self, plan, q, k_cache, v_cache, scale, out):
        if q.dtype == torch.float32 and q.is_cuda:  # no fp32 kernels in FlashInfer
            from sgl_loopkv.attention.sparse_executor import TritonSparseExecutor

            self._triton = self._triton or TritonSparseExecutor(self.dense)
            return self._triton.run(plan, q, k_cache, v_cache, scale, out)
        base = plan.base
        assert base.causal, "sparse plans are causal prefill"
        for i, mask in enumerate(plan.masks):
            if mask is None and base.q_len(i):
                run_dense(self.dense, base, i, q, k_cache, v_cache, scale, out)
        reqs = self.plan(plan, q, k_cache, scale)
        if reqs is not None:
            self.execute(reqs, q, k_cache, v_cache, out)
        return out

    def plan(self, plan: SparsePlan, q, k_cache, scale) -> Requests | None:
        """Build the requests and ``plan()`` them (host work; None when no sequence is sparse)."""
        Hq, H, D = q.shape[1], k_cache.shape[1], q.shape[2]
        reqs = build_requests(plan, H, q.device)
        if not reqs.seqs:
            return None
        self._wrapper.plan(
            reqs.qo_indptr,
            reqs.kv_indptr,
            reqs.kv_indices,
            torch.ones(len(reqs.qo_indptr) - 1, dtype=torch.int32),  # page size 1: every last page is full
            Hq // H,
            1,
            D,
            1,
            causal=True,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
            o_data_type=q.dtype,
        )
        return reqs

    def execute(self, reqs: Requests, q, k_cache, v_cache, out) -> None:
        """``run()`` the planned requests and scatter the rows back into ``out``."""
        Hq, H = q.shape[1], k_cache.shape[1]
        G = Hq // H
        head_major = lambda x: x.view(-1, H, G, x.shape[-1]).transpose(0, 1).reshape(-1, G, x.shape[-1])  # noqa: E731
        q_req = torch.cat([head_major(q[q0:q1]) for _, q0, q1 in reqs.seqs])
        pages = lambda x: (x if x.is_contiguous() else x.contiguous()).view(-1, 1, 1, x.shape[-1])  # noqa: E731
        o = self._wrapper.run(q_req, (pages(k_cache), pages(v_cache)))
        r0 = 0
        for _, q0, q1 in reqs.seqs:
            n = q1 - q0
            out[q0:q1] = o[r0 : r0 + H * n].view(H, n, G, -1).transpose(0, 1).reshape(n, Hq, -1)
            r0 += H * n
