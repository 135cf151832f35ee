"""Block sparsity: per query block and KV head, the key blocks with the largest estimated
attention mass, up to ``alpha`` of it.

The estimate is the usual pooled one (MInference's block-sparse pattern, FlexPrefill): the mean
query of the block's new rows against the mean key of each key block, ``log(block length)`` added
so a block scores like the sum of its keys, softmax over the causal blocks, averaged over the GQA
group. Blocks are taken in decreasing estimated mass until the kept estimate reaches ``alpha``;
the sink block 0 and the diagonal block are always kept (pooling blurs single sink tokens, and the
diagonal keeps every row non-empty). The order does not depend on alpha, so the selected set is
monotone in alpha, and alpha >= 1 keeps every block (dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_loopkv.attention.policies import POLICIES, SelectionPolicy, dense_tail_blocks, full_heads
from sgl_loopkv.attention.sparse_plan import SeqMask


@dataclass
class BlockTopPolicy(SelectionPolicy):
    alpha: float = 0.95
    block_size: int = 64
    dense_tail: int = 0  # see policies.dense_tail_blocks
    full_density: float = 1.0  # see policies.full_heads

    def select(self, layer_id, q, k, scale):
        n, L, H, B = q.shape[0], k.shape[0], k.shape[1], self.block_size
        if self.alpha >= 1:
            return SeqMask.all_blocks(H, L, n, B)
        est = block_mass(q, k, scale, B)  # [H, nqb, nb]
        nqb, nb = est.shape[1:]
        diag = torch.arange(nqb) + (nb - nqb)
        forced = est.clone()
        forced[:, :, 0] = math.inf
        forced[:, torch.arange(nqb), diag] = math.inf
        order = torch.sort(forced, dim=-1, descending=True, stable=True).indices
        kept = est.gather(-1, order).cumsum(-1)
        count = ((kept < self.alpha).sum(-1, keepdim=True) + 1).clamp(max=nb)  # [H, nqb, 1]
        take = torch.arange(nb)[None, None, :] < count
        table = torch.zeros(H, nqb, nb, dtype=torch.bool).scatter_(-1, order, take)
        dense_tail_blocks(table, L, n, B, self.dense_tail)
        return full_heads(SeqMask.from_block_table(table, L, n, B), self.full_density)


@POLICIES.register("block")
def _create(config, model) -> BlockTopPolicy:
    return BlockTopPolicy(
        alpha=config.alpha,
        block_size=config.block_size,
        dense_tail=config.dense_tail,
        full_density=config.full_density,
    )


def block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Estimated attention mass of each key block for each query block of the new rows:
    q [n, Hq, D], k [L, Hkv, D] -> [Hkv, num_q_blocks, num_blocks], rows sum to 1 over causal blocks."""
    n, Hq, D = q.shape
    L, H, _ = k.shape
    B, P = block_size, L - n
    nb, qb0 = -(-L // B), P // B
    qpos = torch.arange(P, L) // B - qb0
    qsum = torch.zeros(nb - qb0, Hq, D, dtype=torch.float32).index_add_(0, qpos, q.float())
    qbar = qsum / torch.bincount(qpos, minlength=nb - qb0).clamp(min=1)[:, None, None]
    kpos = torch.arange(L) // B
    klen = torch.bincount(kpos, minlength=nb).float()
    kbar = torch.zeros(nb, H, D).index_add_(0, kpos, k.float()) / klen[:, None, None]
    kbar = kbar.repeat_interleave(Hq // H, dim=1)
    s = torch.einsum("qhd,khd->hqk", qbar, kbar) * scale + klen.log()
    s.masked_fill_(torch.arange(nb)[None, None, :] > (torch.arange(nb - qb0) + qb0)[None, :, None], -math.inf)
    return s.softmax(-1).view(H, Hq // H, nb - qb0, nb).mean(1)
