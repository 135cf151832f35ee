"""Chunks of a stored history: which ones a new turn needs (ContiguousKV's selection unit).

A chunk is the tiers' 16-token unit of storage and I/O. Its stored summary is the per-KV-head,
per-channel key min/max (:func:`sgl_loopkv.selection.pages.chunk_minmax`, written with every
segment), so the new turn's queries score every chunk without reading a key: the bound
:func:`~sgl_loopkv.selection.pages.score_bound` of each (query row, query head) over each chunk is
turned into an estimated attention distribution over the chunks (softmax of bound * scale, plus
log(chunk) for the chunk's keys), and a chunk's score is its mean mass over rows and heads. One set
serves every head of a layer (a chunk is read whole: all heads, K and V).
"""

from __future__ import annotations

import math

import torch

from sgl_loopkv.selection.pages import score_bound

MAX_SCORING_ROWS = 128  # query rows scored per selection: evenly spaced over the new turn, its last row included


def scoring_rows(q: torch.Tensor, limit: int = MAX_SCORING_ROWS) -> torch.Tensor:
    """At most ``limit`` rows of ``q`` [n, ...], evenly spaced, the last one always in."""
    n = q.shape[0]
    if n <= limit:
        return q
    idx = torch.linspace(0, n - 1, limit, device=q.device).round().long()
    return q[idx]


def chunk_scores(q: torch.Tensor, summaries: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
    """Estimated attention mass of each chunk. q: [n, Hq, D] (the new turn's query rows of one
    layer); summaries: [m, Hkv, 2, D] (that layer's chunk min/max) -> [m] float32, summing to 1."""
    q = scoring_rows(q)
    n, hq, d = q.shape
    hkv = summaries.shape[1]
    qg = q.float().view(n, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, n * g, D]
    bound = score_bound(qg, summaries.float())  # [Hkv, n * g, m]
    mass = torch.softmax(bound * scale + math.log(chunk), dim=-1)
    return mass.mean(dim=(0, 1))


def keep_count(n_chunks: int, budget: float) -> int:
    """Chunks kept under ``budget`` (a fraction of the history): rounded up to whole chunks, at
    least 2 (the first and the nearest), at most all."""
    return min(n_chunks, max(2, math.ceil(budget * n_chunks - 1e-9)))


def select_chunks(scores: torch.Tensor, keep: int, local: int) -> torch.Tensor:
    """Ascending chunk ids: chunk 0 and the last ``local`` chunks (the ones nearest the new turn)
    always, then the best scored, ``keep`` in all (``keep`` >= 2 keeps the first and the last even
    when ``local`` does not fit)."""
    m = scores.shape[0]
    if keep >= m:
        return torch.arange(m)
    s = scores.float().cpu().masked_fill(always_kept(m, keep, local), torch.inf)
    return s.topk(keep).indices.sort().values


def always_kept(m: int, keep: int, local: int) -> torch.Tensor:
    """[m] bool: the chunks :func:`select_chunks` keeps whatever their scores (the first, the nearest)."""
    forced = torch.zeros(m, dtype=torch.bool)
    forced[0] = True
    forced[m - max(1, min(local, keep - 1)) :] = True
    return forced


# --- the IMPRESS-style baseline: exact keys, token-granular selection, block-granular reads --------
def token_scores(q: torch.Tensor, keys: torch.Tensor, scale: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention mass of each history token. q: [n, Hq, D] (the new turn's query rows of one
    layer); keys: [T, Hkv, D]; ``valid`` [T] bool (False: a token whose key did not load, never
    chosen) -> [T] float32 summing to 1 over the valid tokens (softmax over the history per row and
    head, mean over rows and heads: the same pooling as :func:`chunk_scores`)."""
    q = scoring_rows(q)
    n, hq, d = q.shape
    hkv = keys.shape[1]
    qg = q.float().view(n, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, n * g, D]
    logits = torch.bmm(qg, keys.float().permute(1, 2, 0)) * scale  # [Hkv, n * g, T]
    if valid is not None:
        logits = logits.masked_fill(~valid.to(logits.device), -torch.inf)
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(dim=(0, 1)).cpu()


def select_tokens(
    scores: torch.Tensor, keep_tokens: int, chunk: int, local: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """IMPRESS-style: the ``keep_tokens`` best tokens by exact mass (the first chunk's and the
    ``local`` nearest chunks' tokens always among them, as :func:`select_chunks` keeps them) ->
    ([T] bool kept tokens, ascending chunk ids to read: every chunk of each ``block``-token block that
    holds a kept token, the fixed read unit whose waste is IMPRESS's read amplification)."""
    T = scores.shape[0]
    m = T // chunk
    keep_chunks = max(2, -(-keep_tokens // chunk))
    forced = always_kept(m, keep_chunks, local).repeat_interleave(chunk)
    keep_tokens = min(T, max(keep_tokens, int(forced.sum())))
    mask = torch.zeros(T, dtype=torch.bool)
    mask[scores.float().masked_fill(forced, torch.inf).topk(keep_tokens).indices] = True
    per_block = max(1, block // chunk)
    touched = mask.view(m, chunk).any(dim=1)
    pad = (-m) % per_block
    blocks = torch.nn.functional.pad(touched, (0, pad)).view(-1, per_block).any(dim=1)
    read = blocks.repeat_interleave(per_block)[:m]
    return mask, torch.nonzero(read).flatten()
