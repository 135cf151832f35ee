"""Chunk importance for the value policy, measured where it is cheap: in the attention of a turn.

At one probe layer (the middle one), for every extend with a cached prefix, the loopkv attention
backend computes how the newest query rows (at most ``MAX_ROWS``: the new turn, not the whole
prompt) distribute their attention over the prefix, sums it per 16-token chunk and posts it on a
:class:`ChunkImportance` board (shared through :mod:`sgl_loopkv.context`) under the request's row;
the cache collects it at ``checkpoint`` and feeds it to the value policy (ContiguousKV's A_j, Eq. 1, computed on the fly instead of in a separate pass). Everything runs
in the scheduler process.
"""

from __future__ import annotations

import torch

MAX_ROWS = 64


def chunk_attention_mass(q: torch.Tensor, k_prefix: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
    """Attention mass of query rows q [n, Hq, D] on prefix keys [P, Hkv, D], summed over heads and
    rows, per chunk of ``chunk`` keys -> [ceil(P / chunk)]."""
    group = q.shape[1] // k_prefix.shape[1]
    k = k_prefix.to(q.dtype).repeat_interleave(group, dim=1)
    probs = torch.einsum("nhd,phd->hnp", q, k).mul_(scale).softmax(dim=-1)
    mass = probs.sum(dim=(0, 1))
    pad = (-mass.numel()) % chunk
    return torch.nn.functional.pad(mass, (0, pad)).view(-1, chunk).sum(dim=1).float().cpu()


class ChunkImportance:
    """The per-request board: the attention posts chunk mass at the probe layer, the cache pops a
    request's mass at its turn's end. Off (no probe layer) until the cache configures it."""

    def __init__(self) -> None:
        self.probe_layer: int | None = None
        self.chunk = 16
        self._board: dict[int, torch.Tensor] = {}

    def configure(self, probe_layer: int | None, chunk: int) -> None:
        self.probe_layer, self.chunk = probe_layer, chunk
        self._board.clear()

    def wants(self, layer_id: int, is_decode: bool) -> bool:
        return self.probe_layer == layer_id and not is_decode

    def record(self, plan, req_rows: list[int], q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        """Post the chunk mass of every sequence in the batch that extends a cached prefix."""
        for i, row in enumerate(req_rows):
            prefix = plan.prefix_len(i)
            if prefix < self.chunk or plan.q_len(i) == 0:
                continue
            q0, q1 = plan.qo_indptr[i], plan.qo_indptr[i + 1]
            rows = q[max(q0, q1 - MAX_ROWS) : q1]
            mass = chunk_attention_mass(rows, plan.kv_of(i, k_cache)[:prefix], scale, self.chunk)
            old = self._board.get(row)
            self._board[row] = (
                mass if old is None or len(old) > len(mass) else torch.cat([old + mass[: len(old)], mass[len(old) :]])
            )

    def pop(self, req_row: int) -> torch.Tensor | None:
        return self._board.pop(req_row, None)
