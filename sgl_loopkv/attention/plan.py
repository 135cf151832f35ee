"""Attention plans: which KV-pool slots each query row attends to, decided once per batch.

A plan is an index structure in the CSR style FlashInfer uses (``indptr`` + ``indices``), so the
same object can drive the torch executor on CPU and a FlashInfer ``plan()`` on GPU. The dense plan
below lists every slot of every sequence; sparse policies (later issues) emit plans that keep a
subset of slots, blocks or lines per head, and executors must treat the dense plan as the
"budget = 100%" special case of theirs.

Layout of one batch (``bs`` sequences; sequence ``i`` has ``L_i`` keys, the last ``n_i`` of
which are this forward's new tokens)::

    q rows       [ q of seq 0 (n_0 rows) | q of seq 1 (n_1 rows) | ... ]     qo_indptr[i]..qo_indptr[i+1]
    kv_indices   [ slots of seq 0 (L_0)  | slots of seq 1 (L_1)  | ... ]     kv_indptr[i]..kv_indptr[i+1]

    row r of seq i sits at position (L_i - n_i + r) and sees keys 0 .. L_i - n_i + r (causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionPlan:
    """Dense per-batch plan. Host-side offsets are Python lists: executors slice with them
    without a device sync.

    qo_indptr:  [bs + 1] offsets of each sequence's query rows in ``q`` (tokens).
    kv_indptr:  [bs + 1] offsets of each sequence's keys in ``kv_indices`` (tokens).
    kv_indices: [kv_indptr[-1]] int64 KV-pool slot of every key, in position order.
    causal:     False for encoder-only / cross attention, where every row sees every key.
    kv_runs:    per sequence, its slots as ascending runs [(first slot, length), ...] when there are
                at most ``MAX_RUNS`` of them (pages of a paged pool usually are), else None. Executors
                then read the pool through views instead of gathering the whole prefix per layer.
                Computed on first use per sequence (a decode batch run by the native kernel never
                needs them) unless given.
    """

    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: torch.Tensor
    causal: bool = True
    kv_runs: list[list[tuple[int, int]] | None] | None = None
    _kv_indptr_tensor: torch.Tensor | None = None

    def __post_init__(self):
        assert len(self.qo_indptr) == len(self.kv_indptr), "one q span and one kv span per sequence"
        assert self.kv_indices.numel() == self.kv_indptr[-1]
        for i in range(self.batch_size):
            if self.q_len(i) > self.kv_len(i):
                raise ValueError(f"sequence {i}: {self.q_len(i)} queries but only {self.kv_len(i)} keys")

    @property
    def batch_size(self) -> int:
        return len(self.qo_indptr) - 1

    def q_len(self, i: int) -> int:
        return self.qo_indptr[i + 1] - self.qo_indptr[i]

    def kv_len(self, i: int) -> int:
        return self.kv_indptr[i + 1] - self.kv_indptr[i]

    def prefix_len(self, i: int) -> int:
        """Keys before the first new query row of sequence ``i`` (its causal offset)."""
        return self.kv_len(i) - self.q_len(i)

    def kv_slots(self, i: int) -> torch.Tensor:
        return self.kv_indices[self.kv_indptr[i] : self.kv_indptr[i + 1]]

    @property
    def is_decode(self) -> bool:
        """One query row per sequence, each the sequence's last position."""
        return self.qo_indptr[-1] == self.batch_size and all(self.q_len(i) == 1 for i in range(self.batch_size))

    @property
    def kv_indptr_tensor(self) -> torch.Tensor:
        """``kv_indptr`` as an int64 tensor on the indices' device (made once per plan)."""
        if self._kv_indptr_tensor is None:
            self._kv_indptr_tensor = torch.tensor(self.kv_indptr, dtype=torch.int64, device=self.kv_indices.device)
        return self._kv_indptr_tensor

    def runs(self, i: int) -> list[tuple[int, int]] | None:
        if self.kv_runs is None:
            self.kv_runs = [_UNSET] * self.batch_size
        if self.kv_runs[i] is _UNSET:
            self.kv_runs[i] = slot_runs(self.kv_slots(i))
        return self.kv_runs[i]

    def kv_of(self, i: int, cache: torch.Tensor) -> torch.Tensor:
        """Rows of ``cache`` [pool_slots, ...] for sequence ``i``: a view when its slots are one run."""
        runs = self.runs(i)
        if runs is not None and len(runs) == 1:
            return cache[runs[0][0] : runs[0][0] + runs[0][1]]
        return cache[self.kv_slots(i)]


def offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def build_dense_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    seq_lens: list[int],
    q_lens: list[int],
    causal: bool = True,
) -> AttentionPlan:
    """Plan full attention for a batch from SGLang's request table.

    req_to_token: [max_reqs, max_context_len] pool slot of each position of each request row.
    req_pool_indices, seq_lens, q_lens: per sequence; ``seq_lens`` counts the new tokens too
    (decode: q_lens are all 1).
    """
    rows = [req_to_token[r, :n] for r, n in zip(req_pool_indices, seq_lens)]
    kv_indices = torch.cat(rows).to(torch.int64) if rows else req_to_token.new_empty(0, dtype=torch.int64)
    return AttentionPlan(offsets(q_lens), offsets(seq_lens), kv_indices, causal)


MAX_RUNS = 64
_UNSET = object()  # kv_runs entry not computed yet


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]] | None:
    """``slots`` as ascending runs [(first, length), ...], or None if empty or more than MAX_RUNS."""
    if len(slots) == 0:
        return None
    breaks = (torch.nonzero(slots.diff() != 1).flatten() + 1).tolist()
    if len(breaks) >= MAX_RUNS:
        return None
    bounds = [0, *breaks, len(slots)]
    firsts = slots[bounds[:-1]].tolist()
    return [(f, b - a) for f, a, b in zip(firsts, bounds[:-1], bounds[1:])]
