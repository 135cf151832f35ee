"""LoopServe's online vertical/slash selection (Algorithm 5), per layer and KV head.

For the ``n`` new rows of a sequence (positions P .. L-1, P = cached prefix):

1. sample ``sample_rows`` of them (seeded: the same input gives the same plan) and compute their
   exact causal attention over all L keys, averaged over the KV head's GQA group;
2. sum it per *vertical* line (key c) and per *slash* line;
3. order all lines by mass per computed cell, w / l, l being the cells the line adds inside the
   new rows (the cost in the paper's Eq. 1); the diagonal slash first, so no row is ever empty;
4. take the shortest prefix of that order whose lines cover >= alpha of the sampled mass.

Slash lines are block diagonals: slash j is key block b - j for every query block b, i.e. the
paper's slash lines quantized to the block grid, the unit a block kernel executes (MInference's
kernels round slashes to 64-wide ranges the same way). A token-wide slash would cost a whole
block per query block anyway, so selecting it at token granularity with a one-cell cost picks
lines whose executed cost is B times what the greedy assumed. Vertical lines stay token-wide: the
executor gathers single key columns.

Step 3 drops the paper's overlap corrections to the marginal gain (a vertical and a slash meet in
at most one cell per row); step 4 is exact instead of the paper's lower bound: every sampled cell
gets the rank of the first selected line through it, and the cumsum of a histogram of mass by rank
gives the covered mass of every prefix at once. Because the selected lines are exactly the mask
that is executed, the coverage guarantee holds exactly on the sampled rows; the selected set at
alpha1 is a prefix of (so contained in) the set at alpha2 > alpha1; and alpha >= 1 is the guard
case: every line, i.e. every causal key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_loopkv.attention.policies import POLICIES, SelectionPolicy, dense_tail_blocks, full_heads
from sgl_loopkv.attention.sampled import sampled_attention
from sgl_loopkv.attention.sparse_plan import SeqMask


@dataclass
class VerticalSlashPolicy(SelectionPolicy):
    alpha: float = 0.95
    block_size: int = 64
    sample_rows: int = 48  # the paper's |X~|
    seed: int = 0
    dense_tail: int = 0  # the query blocks holding the last rows see every key (see dense_tail_blocks)
    tail_samples: int = 0  # of the sampled rows, this many are the last ones (MInference's last_q)
    full_density: float = 1.0  # a head whose plan reaches this density runs dense (see full_heads)

    def select(self, layer_id, q, k, scale):
        n, L, H, B = q.shape[0], k.shape[0], k.shape[1], self.block_size
        if self.alpha >= 1:
            return SeqMask.all_blocks(H, L, n, B)
        P = L - n
        pos = P + sample_rows(n, self.sample_rows, self.seed * 1_000_003 + layer_id, self.tail_samples)
        attn = sampled_attention(q[pos - P], k, pos, scale)  # [H, s, L]
        nb, qb0 = -(-L // B), P // B
        table = torch.zeros(H, nb - qb0, nb, dtype=torch.bool)
        cols = []
        qb, kb = torch.arange(qb0, nb)[:, None], torch.arange(nb)[None, :]
        for h in range(H):
            verticals, slashes, _ = select_lines(attn[h], pos, P, B, self.alpha)
            on = torch.zeros(nb, dtype=torch.bool)
            on[slashes] = True
            table[h] = on[(qb - kb).clamp(min=0)] & (kb <= qb)
            cols.append(verticals)
        dense_tail_blocks(table, L, n, B, self.dense_tail)
        return full_heads(SeqMask.from_block_table(table, L, n, B, cols), self.full_density)


@POLICIES.register("loopserve")
def _create(config, model) -> VerticalSlashPolicy:
    return VerticalSlashPolicy(
        alpha=config.alpha,
        block_size=config.block_size,
        dense_tail=config.dense_tail,
        tail_samples=config.tail_samples,
        full_density=config.full_density,
    )


def sample_rows(n: int, count: int, seed: int, tail: int = 0) -> torch.Tensor:
    """``min(count, n)`` distinct row indices in 0..n-1, ascending, deterministic in ``seed``: the
    last ``min(tail, count)`` rows, the rest uniform over the rows before them."""
    if count >= n:
        return torch.arange(n)
    tail = min(tail, count)
    g = torch.Generator().manual_seed(seed)
    head = torch.randperm(n - tail, generator=g)[: count - tail]
    return torch.cat([head, torch.arange(n - tail, n)]).sort().values


def line_weights(attn: torch.Tensor, pos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """attn [s, L] (zero above each row's position) -> (vertical [L], slash [num_blocks]) masses:
    vertical c sums column c, slash j sums the cells whose key block is the row's block - j."""
    L = attn.shape[1]
    slash = torch.zeros(-(-L // block_size), dtype=attn.dtype)
    slash.scatter_add_(0, _slash_of(pos, L, block_size).reshape(-1), attn.reshape(-1))
    return attn.sum(0), slash


def line_costs(prefix: int, kv_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cells each line adds to the new rows P .. L-1: vertical c spans rows p >= c; slash j spans
    B keys for every row whose block is >= j (the diagonal, j = 0, counts its causal triangle)."""
    B = block_size
    vertical = kv_len - torch.arange(kv_len).clamp(min=prefix)
    rows = torch.bincount(torch.arange(prefix, kv_len) // B, minlength=-(-kv_len // B))  # new rows per block
    slash = B * rows.flip(0).cumsum(0).flip(0)  # slash j: rows in blocks >= j
    slash[0] = (torch.arange(prefix, kv_len) % B + 1).sum()  # causal triangle of each row's own block
    return vertical, slash


def _slash_of(pos: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    """[s, L] slash index (row block - key block) of every sampled cell, 0 above the diagonal."""
    return (pos[:, None] // block_size - torch.arange(kv_len)[None, :] // block_size).clamp(min=0)


def select_lines(
    attn: torch.Tensor, pos: torch.Tensor, prefix: int, block_size: int, alpha: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The vertical/slash lines of one head: attn [s, L] sampled rows at positions ``pos``.

    Returns (vertical key positions, slash indices, covered fraction of the sampled mass), the
    fraction >= alpha (alpha >= 1: every line)."""
    L = attn.shape[1]
    w_v, w_s = line_weights(attn, pos, block_size)
    c_v, c_s = line_costs(prefix, L, block_size)
    nv, ns = L, len(w_s)
    mass_per_cell = torch.cat([w_v / c_v, w_s / c_s.clamp(min=1)])  # lines 0..L-1 vertical, then slashes
    mass_per_cell[nv] = float("inf")  # the diagonal first: no empty row
    order = torch.sort(mass_per_cell, descending=True, stable=True).indices
    if alpha >= 1:
        count, covered = nv + ns, 1.0
    else:
        rank = torch.empty(nv + ns, dtype=torch.int64)
        rank[order] = torch.arange(nv + ns)
        # every cell is covered from the rank of the first selected line through it
        cell_rank = torch.minimum(rank[:nv].expand_as(attn), rank[nv:][_slash_of(pos, L, block_size)])
        mass = torch.bincount(cell_rank.view(-1), weights=attn.view(-1), minlength=nv + ns).cumsum(0)
        total = attn.sum()
        count = min(nv + ns, int((mass < alpha * total).sum()) + 1)
        covered = float(mass[count - 1] / total)
    chosen = order[:count]
    verticals, slashes = chosen[chosen < nv].sort().values, (chosen[chosen >= nv] - nv).sort().values
    return verticals, slashes, covered


def covered_fraction(
    attn: torch.Tensor, pos: torch.Tensor, verticals: torch.Tensor, slashes: torch.Tensor, block_size: int
) -> float:
    """Fraction of the sampled mass on the given lines (each cell counted once)."""
    L = attn.shape[1]
    on_v = torch.zeros(L, dtype=torch.bool)
    on_v[verticals] = True
    on_s = torch.zeros(-(-L // block_size), dtype=torch.bool)
    on_s[slashes] = True
    cells = on_v[None, :] | on_s[_slash_of(pos, L, block_size)]
    return float((attn * cells).sum() / attn.sum())
