"""Sparse attention plans: which keys each new query row sees, per KV head, as index lists.

A selection policy (``policies/``) turns one layer's q/k of one sequence into a :class:`SeqMask`;
a :class:`SparsePlan` bundles the batch's dense :class:`AttentionPlan` (where the keys live in the
KV pool) with one mask per sequence (``None``: that sequence stays dense). Masks are plain CSR
index tensors on the host, the same structure FlashInfer's block-sparse ``plan()``, a flex_attention
``BlockMask`` or a Triton kernel's block table are built from.

Layout of one sequence (``L`` keys, the last ``n`` of which are this forward's new rows; block size
``B``; blocks are aligned on absolute positions, so query block ``b`` and key block ``b`` hold the
same positions and key block ``b`` is query block ``b``'s causal diagonal)::

    key blocks     0   1   2  ...  qb0 ... nb-1          nb  = ceil(L / B)
    query blocks                   qb0 ... nb-1          qb0 = (L - n) // B   (first may be partial:
                                   row j of the CSR                            rows before L - n are
                                   is block qb0 + j                            the cached prefix)

    row at position p, head h sees key c  iff  c <= p  and
        full[h]  or  c // B in blocks(h, p // B)  or  c in cols(h)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_loopkv.attention.plan import AttentionPlan


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _causal_cells(prefix: int, kv_len: int) -> int:
    """Cells of rows ``prefix .. kv_len - 1`` under a causal mask: row p sees p + 1 keys."""
    return (kv_len * (kv_len + 1) - prefix * (prefix + 1)) // 2


@dataclass(slots=True)
class SeqMask:
    """One sequence's sparse mask for one layer, per KV head (shared by the head's GQA group).

    block_indptr:  [num_heads * num_q_blocks + 1] int64 CSR offsets over (head, query block),
                   head-major.
    block_indices: [nnz] int64 absolute key blocks, ascending per row; every row ends with its own
                   diagonal block (so no query row is ever empty) and holds nothing after it.
                   Rows of ``full`` heads are empty.
    col_indptr:    [num_heads + 1] int64; col_indices: absolute key positions every row of the head
                   sees (causally), ascending and unique: LoopServe's vertical lines. A column may
                   fall in a selected block: executors count each key once.
    full:          per head, True = every causal key (LServe's dense heads; a dense kernel may run).
    """

    kv_len: int
    q_len: int
    block_size: int
    block_indptr: torch.Tensor
    block_indices: torch.Tensor
    col_indptr: torch.Tensor
    col_indices: torch.Tensor
    full: list[bool]

    def __post_init__(self):
        if not 0 < self.q_len <= self.kv_len:
            raise ValueError(f"need 0 < q_len <= kv_len, got {self.q_len}, {self.kv_len}")
        if len(self.block_indptr) != self.num_heads * self.num_q_blocks + 1:
            raise ValueError("block_indptr must have num_heads * num_q_blocks + 1 entries")
        if len(self.col_indptr) != self.num_heads + 1:
            raise ValueError("col_indptr must have num_heads + 1 entries")

    # --- geometry -------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return len(self.full)

    @property
    def prefix_len(self) -> int:
        return self.kv_len - self.q_len

    @property
    def num_blocks(self) -> int:
        return _cdiv(self.kv_len, self.block_size)

    @property
    def first_q_block(self) -> int:
        return self.prefix_len // self.block_size

    @property
    def num_q_blocks(self) -> int:
        return self.num_blocks - self.first_q_block

    def blocks(self, head: int, q_block: int) -> torch.Tensor:
        """Key blocks of absolute query block ``q_block`` (empty for a full head)."""
        r = head * self.num_q_blocks + q_block - self.first_q_block
        return self.block_indices[self.block_indptr[r] : self.block_indptr[r + 1]]

    def cols(self, head: int) -> torch.Tensor:
        return self.col_indices[self.col_indptr[head] : self.col_indptr[head + 1]]

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_block_table(
        cls,
        table: torch.Tensor,
        kv_len: int,
        q_len: int,
        block_size: int,
        cols: list[torch.Tensor] | None = None,
        full: list[bool] | None = None,
    ) -> SeqMask:
        """From a boolean table [num_heads, num_q_blocks, num_blocks] (row j = query block qb0 + j).
        Adds every row's diagonal, drops blocks after it (non-causal) and full heads' rows."""
        H, nqb, nb = table.shape
        qb0 = nb - nqb
        assert nb == _cdiv(kv_len, block_size) and qb0 == (kv_len - q_len) // block_size, "table shape"
        full = list(full) if full is not None else [False] * H
        diag = torch.arange(nqb) + qb0
        causal = torch.arange(nb)[None, :] <= diag[:, None]
        table = (table.bool() & causal).clone()
        table[:, torch.arange(nqb), diag] = True
        table[torch.tensor(full, dtype=torch.bool)] = False
        counts = table.sum(-1).reshape(-1)
        indptr = torch.zeros(H * nqb + 1, dtype=torch.int64)
        indptr[1:] = counts.cumsum(0)
        indices = table.reshape(H * nqb, nb).nonzero()[:, 1]  # row-major: ascending per row
        cols = cols if cols is not None else [torch.empty(0, dtype=torch.int64)] * H
        cols = [torch.unique(c.to(torch.int64)) for c in cols]  # sorted, unique
        col_indptr = torch.zeros(H + 1, dtype=torch.int64)
        col_indptr[1:] = torch.tensor([len(c) for c in cols]).cumsum(0)
        col_indices = torch.cat(cols) if cols else torch.empty(0, dtype=torch.int64)
        return cls(kv_len, q_len, block_size, indptr, indices, col_indptr, col_indices, full)

    @classmethod
    def all_blocks(cls, num_heads: int, kv_len: int, q_len: int, block_size: int) -> SeqMask:
        """Every causal key, listed block by block (full budget, run by the sparse kernels)."""
        nb = _cdiv(kv_len, block_size)
        table = torch.ones(num_heads, nb - (kv_len - q_len) // block_size, nb, dtype=torch.bool)
        return cls.from_block_table(table, kv_len, q_len, block_size)

    def block_table(self) -> torch.Tensor:
        """Inverse of :meth:`from_block_table`: bool [num_heads, num_q_blocks, num_blocks]."""
        H, nqb, nb = self.num_heads, self.num_q_blocks, self.num_blocks
        table = torch.zeros(H * nqb, nb, dtype=torch.bool)
        rows = torch.repeat_interleave(torch.arange(H * nqb), self.block_indptr.diff())
        table[rows, self.block_indices] = True
        return table.view(H, nqb, nb)

    def spelled_out(self) -> SeqMask:
        """This mask with each ``full`` head's causal blocks listed: for kernels that only walk lists
        (a full head then costs what the dense causal triangle does)."""
        if not any(self.full):
            return self
        table = self.block_table()
        table[torch.tensor(self.full)] = True
        cols = [self.cols(h) for h in range(self.num_heads)]
        return SeqMask.from_block_table(table, self.kv_len, self.q_len, self.block_size, cols)

    # --- reference semantics (tests, fidelity metrics) ------------------------------------------
    def dense_mask(self, head: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """bool [q_len, kv_len]: True where the head's new rows attend (the definition above);
        only the given rows (indices into the new rows) when ``rows`` is given."""
        B, P = self.block_size, self.prefix_len
        pos = (P + rows if rows is not None else torch.arange(P, self.kv_len))[:, None]
        key = torch.arange(self.kv_len)[None, :]
        causal = key <= pos
        if self.full[head]:
            return causal
        table = self.block_table()[head]  # [nqb, nb]
        seen = table[pos // B - self.first_q_block, key // B]
        col = torch.zeros(self.kv_len, dtype=torch.bool)
        col[self.cols(head)] = True
        return causal & (seen | col[None, :])

    def visible_cells(self) -> list[int]:
        """Per head, the number of (row, key) pairs attended: the work a sparse kernel does,
        counted exactly without materializing the mask."""
        B, P, L, qb0, nqb = self.block_size, self.prefix_len, self.kv_len, self.first_q_block, self.num_q_blocks
        starts = (torch.arange(nqb) + qb0) * B
        lo, hi = starts.clamp(min=P), (starts + B).clamp(max=L)
        rows = hi - lo  # real rows per query block
        diag_cells = ((lo - starts + 1 + hi - starts) * rows) // 2  # row p sees p - start + 1 keys
        out = []
        table = self.block_table()
        for h in range(self.num_heads):
            if self.full[h]:
                out.append(_causal_cells(P, L))
                continue
            off = table[h].clone()
            off[torch.arange(nqb), torch.arange(nqb) + qb0] = False
            cells = (off.sum(-1) * B * rows).sum() + diag_cells.sum()
            c = self.cols(h)
            if len(c):  # columns before the diagonal block whose block is not selected
                extra = (c[None, :] < starts[:, None]) & ~off.gather(1, (c // B)[None, :].expand(nqb, -1))
                cells += (extra.sum(-1) * rows).sum()
            out.append(int(cells))
        return out

    def density(self) -> float:
        """Attended cells / causal cells, over all heads (1.0 = dense)."""
        return sum(self.visible_cells()) / (_causal_cells(self.prefix_len, self.kv_len) * self.num_heads)


@dataclass(slots=True)
class SparsePlan:
    """One layer's plan for a batch: the dense plan (where each sequence's keys live in the KV
    pool) plus, per sequence, a :class:`SeqMask` over its keys or None (dense)."""

    base: AttentionPlan
    masks: list[SeqMask | None]

    def __post_init__(self):
        assert len(self.masks) == self.base.batch_size
        for i, m in enumerate(self.masks):
            if m is not None and (m.kv_len, m.q_len) != (self.base.kv_len(i), self.base.q_len(i)):
                raise ValueError(
                    f"sequence {i}: mask for {m.q_len}/{m.kv_len} rows/keys, plan has "
                    f"{self.base.q_len(i)}/{self.base.kv_len(i)}"
                )
