"""Krul's per-conversation layer statistics (paper §4.2 / §5), accumulated row by row.

For every attention row (one query position, every query head) of every layer the estimator adds

* ``sq_dist[i, j, h] += ||P_i[h, row] - P_j[h, row]||^2``: the squared Euclidean distance between
  the attention rows of layers i and j. Summing *squared* distances and taking the root at the end
  makes the streamed distance exactly the distance over the whole (ragged, causal) attention
  history, however the rows arrive: prefill chunks, decode steps, earlier turns. (Krul "adds up"
  per-part distances, which is not the same quantity.)
* ``ir_mass[l] += sum_h (mass on the initial window + mass on the recent window)`` of that row.

I-R statistic (Alg. 1 lines 1-12), made causal and additive: Krul takes the first and last 10% of
the *whole* prompt's keys for every row; with a causal mask a row in the first 10% then has all its
mass in the "initial" window and a row before 90% none in the "recent" one, so the score says more
about the prompt length than about the layer, and it cannot be updated as turns are appended. Here
each row at position p (keys 0..p) uses its own windows: the first and the last
``ceil(IR_FRACTION * (p + 1))`` of its keys (the paper's windows for the last row). Rows with fewer
than ``IR_MIN_KEYS`` keys, where both windows would cover most keys, are not counted.

Probabilities are computed block by block of rows for all layers at once from saved queries and the
pool's keys, so nothing of size O(layers x heads x rows x keys) is ever held for a long prompt.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

IR_FRACTION = 0.1
IR_MIN_KEYS = 64
#: Probabilities held at once per block: layers x rows x keys (one head), 4 bytes each (~32 MiB).
BLOCK_ELEMS = 8 << 20


@dataclass
class LayerStats:
    """Additive attention statistics of a set of rows: ``a + b`` is the statistics of both row sets.

    sq_dist: [L, L, Hq] float64, symmetric, zero diagonal: summed squared row distances per query head.
    ir_mass: [L] float64: summed (initial + recent window) mass over counted rows and heads.
    ir_rows: weighted count of rows counted in ``ir_mass`` (rows with >= IR_MIN_KEYS keys).
    rows:    weighted count of rows in ``sq_dist`` (a sampled row stands for ``stride`` rows).
    """

    num_layers: int
    num_heads: int
    sq_dist: torch.Tensor = field(default=None)
    ir_mass: torch.Tensor = field(default=None)
    ir_rows: float = 0.0
    rows: float = 0.0

    def __post_init__(self):
        if self.sq_dist is None:
            self.sq_dist = torch.zeros(self.num_layers, self.num_layers, self.num_heads, dtype=torch.float64)
        if self.ir_mass is None:
            self.ir_mass = torch.zeros(self.num_layers, dtype=torch.float64)

    def __add__(self, other: LayerStats) -> LayerStats:
        if (self.num_layers, self.num_heads) != (other.num_layers, other.num_heads):
            raise ValueError("LayerStats of different models")
        return LayerStats(
            self.num_layers,
            self.num_heads,
            self.sq_dist + other.sq_dist,
            self.ir_mass + other.ir_mass,
            self.ir_rows + other.ir_rows,
            self.rows + other.rows,
        )

    def distance(self) -> torch.Tensor:
        """[L, L] float64: per-head Euclidean distance over all rows, averaged over heads (Krul)."""
        return self.sq_dist.clamp_min(0).sqrt().mean(dim=-1)

    def ir_score(self) -> torch.Tensor:
        """[L] float64 in [0, 1]: mean initial+recent mass per counted row and head (0 if none)."""
        return self.ir_mass / max(self.ir_rows * self.num_heads, 1e-12)

    def to_json(self) -> str:
        return json.dumps(
            {
                "num_layers": self.num_layers,
                "num_heads": self.num_heads,
                "sq_dist": self.sq_dist.flatten().tolist(),
                "ir_mass": self.ir_mass.tolist(),
                "ir_rows": self.ir_rows,
                "rows": self.rows,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> LayerStats:
        d = json.loads(raw)
        L, H = d["num_layers"], d["num_heads"]
        return cls(
            L,
            H,
            torch.tensor(d["sq_dist"], dtype=torch.float64).view(L, L, H),
            torch.tensor(d["ir_mass"], dtype=torch.float64),
            d["ir_rows"],
            d["rows"],
        )


def ir_window_mass(probs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """probs [..., n, K] (row r sees keys 0..pos[r], zero beyond), pos [n] -> [..., n]: mass on the
    row's first and last ``ceil(IR_FRACTION * (pos + 1))`` keys (their union when they overlap)."""
    count = pos + 1
    w = torch.ceil(count.double() * IR_FRACTION).long().clamp_min(1)
    cs = probs.cumsum(dim=-1)
    shape = (*probs.shape[:-1], 1)

    def at(idx):
        return cs.gather(-1, idx[:, None].expand(shape)).squeeze(-1)

    init, before_recent, total = at(w - 1), at((count - w - 1).clamp_min(0)), at(pos)
    recent = total - torch.where(count - w - 1 >= 0, before_recent, torch.zeros_like(before_recent))
    overlap = 2 * w >= count
    return torch.where(overlap, total, init + recent)


def row_stats(
    q: torch.Tensor,
    k: list[torch.Tensor] | torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    weight: float = 1.0,
    gram_dtype: torch.dtype = torch.float32,
) -> LayerStats:
    """Statistics of ``n`` attention rows of one sequence in every layer.

    q:   [L, n, Hq, D] the rows' queries per layer (after RoPE, as the attention sees them).
    k:   [L, K, Hkv, D] (or a list of L [K, Hkv, D]) the sequence's keys per layer, position order.
    pos: [n] int64 positions of the rows; row r attends to keys 0..pos[r] (all < K).
    weight: what each row counts for (a row sampled with stride s stands for s rows).
    """
    L, n, hq, d = q.shape
    if isinstance(k, torch.Tensor):
        k = list(k.unbind(0))
    hkv = k[0].shape[1]
    group = hq // hkv
    out = LayerStats(L, hq)
    if n == 0:
        return out
    pos = pos.to(torch.int64).cpu()
    order = torch.argsort(pos)  # blocks of neighbouring positions share a key range
    pos, q = pos[order], q[:, order]
    n_keys = int(pos[-1]) + 1
    step = max(1, BLOCK_ELEMS // (L * n_keys))
    counted = pos + 1 >= IR_MIN_KEYS
    out.rows = float(n * weight)
    out.ir_rows = float(counted.sum().item() * weight)
    sq = torch.zeros(L, L, hq, dtype=torch.float64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        bpos = pos[r0:r1]
        kb = int(bpos[-1]) + 1
        mask = torch.arange(kb)[None, :] > bpos[:, None]  # [nb, kb] True = masked (future)
        bcount = counted[r0:r1]
        for g in range(hkv):
            keys = torch.stack([kl[:kb, g] for kl in k]).to(torch.float32)  # [L, kb, D]
            for h in range(g * group, (g + 1) * group):
                scores = torch.bmm(q[:, r0:r1, h].to(torch.float32), keys.transpose(1, 2)).mul_(scale)
                probs = scores.masked_fill_(mask, float("-inf")).softmax(dim=-1)  # [L, nb, kb]
                if bcount.any():
                    ir = ir_window_mass(probs[:, bcount], bpos[bcount])
                    out.ir_mass += ir.double().sum(dim=1) * weight
                sq[:, :, h] += sq_gram(probs.reshape(L, -1), gram_dtype)
    sq.diagonal(dim1=0, dim2=1).zero_()
    out.sq_dist = sq * weight
    return out


def sq_gram(x: torch.Tensor, gram_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [L, M] (each layer's rows flattened) -> [L, L] float64 squared distances ||x_i - x_j||^2 by
    the Gram identity (one matmul instead of L^2 / 2 differences; Krul computes it the same way)."""
    x = x.to(gram_dtype)
    gram = (x @ x.T).double()
    diag = gram.diagonal()
    return (diag[:, None] + diag[None, :] - 2 * gram).clamp_min_(0).fill_diagonal_(0)


def probs_stats(probs: torch.Tensor, pos: torch.Tensor, weight: float = 1.0) -> LayerStats:
    """Statistics of rows whose probabilities are at hand: probs [L, Hq, n, K] (zero past each
    row's position), pos [n]. For a few rows (decode) computed layer by layer during the forward."""
    L, hq, n, _ = probs.shape
    out = LayerStats(L, hq)
    out.rows = float(n * weight)
    for h in range(hq):
        out.sq_dist[:, :, h] = sq_gram(probs[:, h].reshape(L, -1)) * weight
    counted = pos + 1 >= IR_MIN_KEYS
    out.ir_rows = float(counted.sum().item() * weight)
    if counted.any():
        out.ir_mass = ir_window_mass(probs[:, :, counted], pos[counted]).double().sum(dim=(1, 2)) * weight
    return out


def offline_stats(attn: list[torch.Tensor], pos: torch.Tensor | None = None) -> LayerStats:
    """Reference: statistics from full attention matrices ``attn[l]`` [Hq, n, K] (rows at positions
    ``pos``, default the last n of K), by direct differences in float64. For tests and analysis."""
    L, (hq, n, kk) = len(attn), attn[0].shape
    pos = torch.arange(kk - n, kk) if pos is None else pos
    a = torch.stack(attn).double()  # [L, Hq, n, K]
    out = LayerStats(L, hq)
    for i in range(L):
        for j in range(L):
            out.sq_dist[i, j] = (a[i] - a[j]).pow(2).sum(dim=(1, 2))
    counted = pos + 1 >= IR_MIN_KEYS
    out.rows, out.ir_rows = float(n), float(counted.sum())
    if counted.any():
        out.ir_mass = ir_window_mass(a[:, :, counted], pos[counted]).sum(dim=(1, 2))
    return out


def stride_positions(first: int, last: int, stride: int) -> torch.Tensor:
    """Positions in [first, last) that a stride-``stride`` sample keeps: multiples of ``stride``
    (absolute, so chunked prefills and later turns sample the same grid)."""
    start = math.ceil(first / stride) * stride
    return torch.arange(start, max(start, last), stride)  # empty when no multiple lies in the range
