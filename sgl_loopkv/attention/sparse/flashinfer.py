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

Building the page lists (:func:`build_requests`): the host (where the masks live) does work
linear in the mask (listed blocks, columns, query blocks) to get each request's rows and key
count (FlashInfer's plan() wants both on the host) and uploads it in one pinned copy; the device
expands it to one page per key (O(listed keys): every vertical column recurs in every later
query block's list): on CUDA one Triton kernel, on the CPU (and on request) ~45 vectorised torch
ops. No host sync: sizes are known on the host, uploads and plan()'s host inputs are pinned.

Measured on an H100 (benchmarks/results/gpu_sparse.md, loopserve plans, 3 KV heads): per layer,
page lists + FlashInfer's plan() + run cost 1.1-2.3 ms at 8K tokens and 2.6-4.3 ms at 32K (the
previous host-built lists: 4-11 and 67-239 ms); of that, the lists take 0.5-0.9 / 1.1-1.8 ms with
the kernel (torch ops: 1.4-2.1 / 2.3-3.4 ms) and FlashInfer's plan() 0.3-1.1 / 0.9-2.2 ms (host
work, O(requests)). The Triton executor stays cheaper per layer (0.3-0.8 / 0.9-2.2 ms with its
plan). Pages of a whole block (one page size per plan, so a second plan for the columns, merged
by log-sum-exp) were measured too: the kernel runs the same lists at most 7% faster as pages of
64 tokens than of one, and the second plan plus the merge make it 1.15-1.8x slower than one plan.

Sequences without a mask run the dense executor. FlashInfer has no fp32 prefill kernels: fp32
batches run the Triton kernel (same plan semantics) instead. Tested on an H100 with flashinfer
0.7.2 (tests/unit/test_sparse_gpu.py, fa3 and fa2); the request layout also on CPU
(tests/unit/test_sparse_kernels.py, tests/unit/test_sparse_gpu.py). Timings: benchmarks/results/gpu_sparse.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from sgl_loopkv.attention.executor import AttentionExecutor
from sgl_loopkv.attention.sparse.base import SparseExecutor
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan


@dataclass(slots=True)
class Requests:
    """One layer's FlashInfer requests. qo_indptr/kv_indptr/kv_lens/last_page_len: host int32 ([R + 1],
    [R + 1], [R], [R]; pinned when the pages are on a GPU); kv_indices: int32 pages (slot * num_kv_heads + head)
    on the pool's device; seqs: (sequence, q0, q1) of every masked sequence, in request order (each
    contributes num_kv_heads * (q1 - q0) query rows, head-major)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_lens: torch.Tensor
    last_page_len: torch.Tensor
    kv_indices: torch.Tensor
    seqs: list[tuple[int, int, int]]


@dataclass(slots=True)
class _Units:
    """Host counts of one sequence per unit (head, query block), head-major (int64 arrays of
    H * num_q_blocks, except ``col_head``: one entry per listed column)."""

    mask: SeqMask
    full: np.ndarray  # bool: the unit's head is full (one request over every key)
    keep: np.ndarray  # bool: the unit is a request (a full head keeps only its first unit)
    cnt: np.ndarray  # keys of the request
    rows: np.ndarray  # query rows of the request
    nblk: np.ndarray  # whole earlier blocks
    nc: np.ndarray  # columns before the block that no selected block holds
    nd: np.ndarray  # diagonal keys
    ncand: np.ndarray  # candidate columns (every column before the block)
    estart: np.ndarray  # the unit's first entry in mask.block_indices
    head: np.ndarray
    diag: np.ndarray  # the diagonal block's index
    col_start: np.ndarray  # its head's first column in mask.col_indices
    col_head: np.ndarray  # per listed column: its head


@dataclass(slots=True)
class _Batch:
    """Every masked sequence's units, concatenated (what the page-list expansion reads)."""

    B: int  # block size
    us: list[_Units]
    unit_seq: np.ndarray  # per unit: its sequence (index into us)
    first: np.ndarray  # per unit: its first key in kv_indices
    full: np.ndarray
    keep: np.ndarray
    estart: np.ndarray  # per unit: its first entry in the concatenated block indices
    col_start: np.ndarray  # per unit: its head's first column in the concatenated columns
    total: int  # keys of all requests

    def cat(self, name: str) -> np.ndarray:
        """Field ``name`` of every sequence's units, concatenated."""
        return np.concatenate([getattr(u, name) for u in self.us])


def _exclusive(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x) - x


def _units(mask: SeqMask) -> _Units:
    """Host counts of one sequence per unit (head, query block), head-major; O(listed blocks +
    columns + units). A sparse head's unit is one request: nblk whole earlier blocks, nc columns
    (before the block, in no selected block), nd diagonal keys, ``rows`` query rows."""
    B, L, H, qb0, nqb, nb = (
        mask.block_size,
        mask.kv_len,
        mask.num_heads,
        mask.first_q_block,
        mask.num_q_blocks,
        mask.num_blocks,
    )
    indptr, idx = mask.block_indptr.numpy(), mask.block_indices.numpy()
    cols, col_indptr = mask.col_indices.numpy(), mask.col_indptr.numpy()
    starts = (np.arange(nqb) + qb0) * B
    ends = np.minimum(starts + B, L)
    full = np.repeat(np.asarray(mask.full, dtype=bool), nqb)
    lens = np.diff(indptr)
    diag = (np.arange(H)[:, None] * nb + qb0 + np.arange(nqb)).ravel()  # head * nb + diagonal block
    assert (idx[indptr[1:][~full] - 1] == (diag % nb)[~full]).all(), "rows must end with their diagonal"
    ncand = insel = np.zeros(H * nqb, dtype=np.int64)
    if len(cols):
        hc = np.repeat(np.arange(H), np.diff(col_indptr))
        # columns before each query block: cols are ascending per head, so one search over (head, key)
        gc = hc * (nb * B) + cols
        ncand = np.searchsorted(gc, (np.arange(H)[:, None] * (nb * B) + starts).ravel()) - np.repeat(
            col_indptr[:-1], nqb
        )
        # of which in a selected earlier block: columns per (head, block), summed over each row's
        # blocks (the diagonal's columns are no candidates: taken out again)
        colcnt = np.bincount(hc * nb + cols // B, minlength=H * nb)
        cs = np.concatenate([[0], np.cumsum(colcnt[idx + np.repeat(np.arange(H) * nb, np.diff(indptr[::nqb]))])])
        insel = cs[indptr[1:]] - cs[indptr[:-1]] - colcnt[diag]
    nblk = np.maximum(lens - 1, 0)
    nc = ncand - insel
    nd = np.tile(ends - starts, H)
    rows = np.tile(ends - np.maximum(starts, mask.prefix_len), H)
    cnt = nblk * B + nc + nd
    first_j = np.tile(np.arange(nqb) == 0, H)
    cnt = np.where(full, np.where(first_j, L, 0), cnt)  # a full head: one request over every key
    rows = np.where(full, np.where(first_j, mask.q_len, 0), rows)
    return _Units(
        mask=mask,
        full=full,
        keep=~full | first_j,
        cnt=cnt,
        rows=rows,
        nblk=nblk,
        nc=nc,
        nd=nd,
        ncand=ncand,
        estart=indptr[:-1],
        head=np.repeat(np.arange(H), nqb),
        diag=qb0 + np.tile(np.arange(nqb), H),
        col_start=np.repeat(col_indptr[:-1], nqb),
        col_head=np.repeat(np.arange(H), np.diff(col_indptr)),
    )


@functools.cache
def _expand_kernel():
    """The Triton kernel of :func:`_expand_triton` (triton imported on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def expand(
        kv,
        sel,
        slots,
        idx,
        cols,
        rows,
        n,
        H,
        B,
        NB,
        BP: tl.constexpr,
        EC: tl.constexpr,
        CC: tl.constexpr,
        DC: tl.constexpr,
    ):
        # one work item (see _expand_triton's fields): earlier blocks, columns, diagonal run
        r = tl.program_id(0)
        nblk = tl.load(rows + r)
        estart = tl.load(rows + n + r)
        bpos = tl.load(rows + 2 * n + r)
        cpos = tl.load(rows + 3 * n + r)
        dpos = tl.load(rows + 4 * n + r)
        dlen = tl.load(rows + 5 * n + r)
        dkey = tl.load(rows + 6 * n + r)
        ncand = tl.load(rows + 7 * n + r)
        cstart = tl.load(rows + 8 * n + r)
        seq = slots + tl.load(rows + 9 * n + r)  # the sequence's pool slots
        head = tl.load(rows + 10 * n + r)
        srow = sel + r.to(tl.int64) * NB  # the item's block bitmap (only items with columns use it)
        if ncand > 0:
            for z in range(0, NB, CC):
                zo = z + tl.arange(0, CC)
                tl.store(srow + zo, tl.zeros([CC], tl.int8), mask=zo < NB)
            tl.debug_barrier()
        t = tl.arange(0, BP)
        e = tl.arange(0, EC)
        for k0 in range(0, nblk, EC):  # EC whole blocks at a time
            k = k0 + e
            km = k < nblk
            b = tl.load(idx + estart + k, mask=km, other=0)
            tl.store(srow + b, tl.full([EC], 1, tl.int8), mask=km & (ncand > 0))
            m = km[:, None] & (t < B)[None, :]
            s = tl.load(seq + b[:, None] * B + t[None, :], mask=m, other=0)
            tl.store(kv + bpos + k[:, None] * B + t[None, :], (s * H + head).to(tl.int32), mask=m)
        if ncand > 0:
            tl.debug_barrier()  # the bitmap is complete
        c_ar = tl.arange(0, CC)
        for c0 in range(0, ncand, CC):  # candidates: every column before the block; keep those in no block
            w = c0 + c_ar
            wm = w < ncand
            c = tl.load(cols + cstart + w, mask=wm, other=0)
            keep = wm & (tl.load(srow + c // B, mask=wm, other=1) == 0)
            ki = keep.to(tl.int32)
            s = tl.load(seq + c, mask=keep, other=0)
            tl.store(kv + cpos + tl.cumsum(ki, 0) - ki, (s * H + head).to(tl.int32), mask=keep)
            cpos += tl.sum(ki, 0)
        d_ar = tl.arange(0, DC)
        for d0 in range(0, dlen, DC):
            d = d0 + d_ar
            dm = d < dlen
            s = tl.load(seq + dkey + d, mask=dm, other=0)
            tl.store(kv + dpos + d, (s * H + head).to(tl.int32), mask=dm)

    return expand


def build_requests(plan: SparsePlan, num_kv_heads: int, device, kernel: bool | None = None) -> Requests:
    """The requests of every masked sequence of ``plan`` (pages into a pool of ``num_kv_heads``);
    see the module docstring. Per layer: host work linear in the masks, one upload, then the
    expansion: one Triton kernel (``kernel``; default on CUDA) or ~45 torch ops; no host sync."""
    base, H = plan.base, num_kv_heads
    device = torch.device(device)
    pin = device.type == "cuda"
    seqs, us = [], []
    for i, mask in enumerate(plan.masks):
        q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
        if mask is None or q0 == q1:
            continue
        assert mask.num_heads == H, "mask heads != KV heads"
        seqs.append((i, q0, q1))
        us.append(_units(mask))
    if not seqs:
        empty = torch.zeros(1, dtype=torch.int32)
        return Requests(empty, empty, empty[:0], empty[:0], torch.empty(0, dtype=torch.int32, device=device), [])
    B = us[0].mask.block_size
    assert all(u.mask.block_size == B for u in us), "one block size per batch"
    cat = lambda key: np.concatenate([getattr(u, key) for u in us])  # noqa: E731
    n_units = [len(u.cnt) for u in us]
    unit_seq = np.repeat(np.arange(len(us)), n_units)
    cnt, keep, full = cat("cnt"), cat("keep"), cat("full")
    first = _exclusive(cnt)  # unit's first key in kv_indices (dropped units have none)
    rows_u, cnt_u = cat("rows")[keep], cnt[keep]
    R = len(rows_u)
    # plan()'s host inputs in one pinned buffer: its copies to the device then need no sync
    meta = torch.empty(4 * R + 2, dtype=torch.int32, pin_memory=pin)
    np.concatenate(
        [[0], np.cumsum(rows_u), [0], np.cumsum(cnt_u), cnt_u, np.ones_like(cnt_u)], out=meta.numpy(), casting="unsafe"
    )
    qo_indptr, kv_indptr, kv_lens, last_page_len = meta.split([R + 1, R + 1, R, R])
    e_off = _exclusive(np.array([len(u.mask.block_indices) for u in us]))
    c_off = _exclusive(np.array([len(u.mask.col_indices) for u in us]))
    h = _Batch(
        B=B,
        us=us,
        unit_seq=unit_seq,
        first=first,
        full=full,
        keep=keep,
        estart=cat("estart") + e_off[unit_seq],  # the unit's first entry in the concatenated idx
        col_start=cat("col_start") + c_off[unit_seq],  # its head's first column in the concatenated cols
        total=int(cnt.sum()),
    )
    if kernel is None:
        kernel = device.type == "cuda"
    kv = (_expand_triton if kernel else _expand_torch)(base, seqs, h, H, device, pin)
    return Requests(qo_indptr, kv_indptr, kv_lens, last_page_len, kv, seqs)


def _upload(parts: list[np.ndarray], device, pin: bool) -> list[torch.Tensor]:
    """One host -> device copy of int64 arrays (pinned: it needs no sync)."""
    sizes = [len(p) for p in parts]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pin)
    np.concatenate(parts, out=host.numpy(), casting="unsafe")
    return list(host.to(device, non_blocking=True).split(sizes))


def _expand_torch(base, seqs, h: _Batch, H: int, device, pin: bool) -> torch.Tensor:
    """The page list with vectorised torch ops (a fixed number whatever the batch): the CPU path."""
    B, us, unit_seq, first, full, keep, total = h.B, h.us, h.unit_seq, h.first, h.full, h.keep, h.total
    cat = h.cat
    # page table: per (sequence, head) a row of nb * B pages (key -> slot * H + head), flat
    pt_len = [H * u.mask.num_blocks * B for u in us]
    pt_off = _exclusive(np.array(pt_len))
    nb_u = np.repeat([u.mask.num_blocks for u in us], [len(u.cnt) for u in us])
    ptrow = pt_off[unit_seq] // B + cat("head") * nb_u  # page-table row of (sequence, head, block 0)
    sp = ~full
    nblk, nc, nd, ncand = (cat(k)[sp] for k in ("nblk", "nc", "nd", "ncand"))
    first_s, ptrow_s = first[sp], ptrow[sp]
    offx = _exclusive(nblk)
    row_arrays = [
        nblk,
        h.estart[sp] - offx,  # entry k of row r's earlier blocks: idx[k + this]
        ptrow_s,
        first_s - offx * B,  # its first page: this + k * B
        first_s + nblk * B + nc,  # the diagonal's first page
        nd,
        ptrow_s + cat("diag")[sp],
        ncand,
        h.col_start[sp] - _exclusive(ncand),  # candidate k: cols[k + this]
        first_s + nblk * B - _exclusive(nc) - 1,  # + running count of kept candidates
    ]
    nb_max = max(u.mask.num_blocks for u in us)
    # per column: its page-table entry (sequence, head, key) and its block
    col_pt = [off + u.col_head * (u.mask.num_blocks * B) + u.mask.col_indices.numpy() for u, off in zip(us, pt_off)]
    cols = np.concatenate([u.mask.col_indices.numpy() for u in us])
    idx = np.concatenate([u.mask.block_indices.numpy() for u in us])
    dev = _upload([*row_arrays, idx, np.concatenate(col_pt), cols // B], device, pin)
    (d_nblk, d_eoff, d_ptrow, d_fo, d_dpos, d_nd, d_drow, d_ncand, d_cw, d_cp0, d_idx, d_colpt, d_colblk) = dev

    pt = torch.zeros(sum(pt_len), dtype=torch.int32, device=device)
    ar_h = torch.arange(H, device=device)
    for (i, _, _), u, off, n in zip(seqs, us, pt_off, pt_len):
        L = u.mask.kv_len
        slots = base.kv_slots(i).to(device=device, dtype=torch.int64)
        pt[off : off + n].view(H, -1)[:, :L] = (slots * H + ar_h[:, None]).to(torch.int32)
    pt2 = pt.view(-1, B)
    kv = torch.empty(total + B, dtype=torch.int32, device=device)  # [total, total + B): writes to drop
    ar_b = torch.arange(B, device=device)
    nrow = len(nblk)
    row_id = torch.arange(nrow, device=device)
    n_off, n_cand = int(nblk.sum()), int(ncand.sum())
    sel = torch.zeros(nrow * nb_max if n_cand else 0, dtype=torch.uint8, device=device)
    if n_off:  # earlier blocks: whole blocks, B consecutive pages each
        er = torch.repeat_interleave(row_id, d_nblk, output_size=n_off)
        k = torch.arange(n_off, device=device)
        blk = d_idx[k + d_eoff[er]]
        if n_cand:
            sel[er * nb_max + blk] = 1
        kv[(d_fo[er] + k * B)[:, None] + ar_b] = pt2[d_ptrow[er] + blk]
    if nrow:  # diagonal blocks, the last one per head maybe partial
        pos = torch.where(ar_b < d_nd[:, None], d_dpos[:, None] + ar_b, total)
        kv[pos] = pt2[d_drow]
    if n_cand:  # columns: candidates are every column before the block; keep those in no block
        cr = torch.repeat_interleave(row_id, d_ncand, output_size=n_cand)
        w = torch.arange(n_cand, device=device) + d_cw[cr]
        kept = sel[cr * nb_max + d_colblk[w]] == 0
        kv[torch.where(kept, d_cp0[cr] + kept.cumsum(0), total)] = pt[d_colpt[w]]
    for r in np.flatnonzero(full & keep):  # full heads: every key in order
        L = us[unit_seq[r]].mask.kv_len
        kv[first[r] : first[r] + L] = pt[ptrow[r] * B : ptrow[r] * B + L]
    return kv[:total]


_FULL_CHUNK = 4096  # keys per kernel program of a full head (one program per request is too long)


def _expand_triton(base, seqs, h: _Batch, H: int, device, pin: bool) -> torch.Tensor:
    """The page list by one Triton kernel, one program per request (a full head: per 4096 keys):
    the GPU path (the torch one's ~45 launches cost ~1 ms more per layer on an H100 host)."""
    import triton

    B, us, unit_seq, first, full, keep, total = h.B, h.us, h.unit_seq, h.first, h.full, h.keep, h.total
    cat = h.cat
    kvoff = np.asarray(base.kv_indptr)[[i for i, _, _ in seqs]][unit_seq]
    sp = ~full
    nblk, nc, ncand = (cat(k)[sp] for k in ("nblk", "nc", "ncand"))
    bpos = first[sp]
    # full heads: items of up to _FULL_CHUNK keys
    fr = np.flatnonzero(full & keep)
    flen = np.array([us[unit_seq[r]].mask.kv_len for r in fr], dtype=np.int64)
    nchunk = -(-flen // _FULL_CHUNK)
    fu = np.repeat(fr, nchunk)
    f0 = (np.arange(len(fu)) - np.repeat(_exclusive(nchunk), nchunk)) * _FULL_CHUNK  # chunk's first key
    fz = np.zeros(len(fu), dtype=np.int64)
    fields = [  # per work item, field-major
        np.concatenate([nblk, fz]),
        np.concatenate([h.estart[sp], fz]),
        np.concatenate([bpos, fz]),  # earlier blocks from here
        np.concatenate([bpos + nblk * B, fz]),  # columns from here
        np.concatenate([bpos + nblk * B + nc, first[fu] + f0]),  # diagonal (full head: chunk) from here
        np.concatenate([cat("nd")[sp], np.minimum(np.repeat(flen, nchunk) - f0, _FULL_CHUNK)]),  # its length
        np.concatenate([cat("diag")[sp] * B, f0]),  # its first key
        np.concatenate([ncand, fz]),
        np.concatenate([h.col_start[sp], fz]),
        np.concatenate([kvoff[sp], kvoff[fu]]),
        np.concatenate([cat("head")[sp], cat("head")[fu]]),
    ]
    n = len(fields[0])
    idx = np.concatenate([u.mask.block_indices.numpy() for u in us])
    cols = np.concatenate([u.mask.col_indices.numpy() for u in us])
    d_rows, d_idx, d_cols = _upload([np.concatenate(fields), idx, cols], device, pin)
    nb_max = max(u.mask.num_blocks for u in us)
    slots = base.kv_indices.to(device)
    kv = torch.empty(total, dtype=torch.int32, device=device)
    sel = torch.empty(n * nb_max, dtype=torch.int8, device=device)  # per item: its blocks, for the columns
    _expand_kernel()[(n,)](
        kv, sel, slots, d_idx, d_cols, d_rows, n, H, B, nb_max, BP=triton.next_power_of_2(B), EC=8, CC=256, DC=256
    )
    return kv


class FlashInferSparseExecutor(SparseExecutor):
    """One FlashInfer plan + run per layer for all sparse sequences and heads (see the module
    docstring). ``backend``: FlashInfer's ("auto" = fa3 on Hopper, else fa2)."""

    def __init__(self, dense: AttentionExecutor | None = None, workspace_bytes: int = 128 << 20, backend="auto"):
        import flashinfer

        super().__init__(dense)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=backend)
        self._triton = None

    def run(self, plan, q, k_cache, v_cache, scale, out):
        if q.dtype == torch.float32 and q.is_cuda:  # no fp32 kernels in FlashInfer
            from sgl_loopkv.attention.sparse import SPARSE_EXECUTORS

            self._triton = self._triton or SPARSE_EXECUTORS.create("triton", self.dense)
            return self._triton.run(plan, q, k_cache, v_cache, scale, out)
        assert plan.base.causal, "sparse plans are causal prefill"
        return super().run(plan, q, k_cache, v_cache, scale, out)

    def run_masked(self, plan, seqs, q, k_cache, v_cache, scale, out) -> None:
        """Every masked sequence at once: one ``plan()`` and one ``run()``."""
        reqs = self.plan(plan, q, k_cache, scale)
        if reqs is not None:
            self.execute(reqs, q, k_cache, v_cache, out)

    def plan(self, plan: SparsePlan, q, k_cache, scale) -> Requests | None:
        """Build the requests and ``plan()`` them (None when no sequence is sparse)."""
        Hq, H, D = q.shape[1], k_cache.shape[1], q.shape[2]
        reqs = build_requests(plan, H, q.device)
        if not reqs.seqs:
            return None
        self._wrapper.plan(
            reqs.qo_indptr,
            reqs.kv_indptr,
            reqs.kv_indices,
            reqs.last_page_len,  # page size 1: all ones
            Hq // H,
            1,
            D,
            1,
            causal=True,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
            o_data_type=q.dtype,
            seq_lens=reqs.kv_lens,  # pinned: plan() would copy a pageable one of its own (a sync)
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
