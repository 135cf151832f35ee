"""Pages of keys: min/max summaries, the score bound they give, and top-page selection.

A *logical page* is ``page`` consecutive tokens (16: the KV pool's page and the tiers' chunk). Its
summary is the per-KV-head, per-channel min and max of its keys. For a query ``q`` the bound

    score(page) = sum_d max(q_d * kmax_d, q_d * kmin_d)  >=  max over the page's keys of q . k

(each term bounds q_d * k_d for every k_d in [kmin_d, kmax_d]) ranks pages without reading their
keys (Quest; LServe's logical pages). A *physical page* groups several logical pages and scores
the max of theirs (LServe's hierarchy: fine scoring, coarse I/O).
"""

from __future__ import annotations

import torch

from sgl_loopkv.kernels import kv_quant


def chunk_minmax(k: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-chunk, per-head min and max of keys. k: [..., T, H, D] -> [..., ceil(T / chunk), H, 2, D]
    float32; a last partial chunk summarises the tokens it has. Float32 and bfloat16 CPU keys whose
    [T, H, D] are contiguous go through the native kernel (the same bits, one pass)."""
    *lead, T, H, D = k.shape
    rows = kv_quant.chunk_rows(k)
    native = kv_quant.load() if rows is not None else None
    if native is not None:
        return native.chunk_minmax(rows, chunk).view(*lead, -1, H, 2, D)
    return chunk_minmax_torch(k, chunk)


def chunk_minmax_torch(k: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`chunk_minmax` in torch ops (any dtype, layout and device; the native kernel's reference)."""
    *lead, T, H, D = k.shape
    full = T // chunk
    kf = k.float()
    parts = []
    if full:
        kc = kf[..., : full * chunk, :, :].reshape(*lead, full, chunk, H, D)
        parts.append(torch.stack([kc.amin(dim=-3), kc.amax(dim=-3)], dim=-2))
    if T % chunk:
        tail = kf[..., full * chunk :, :, :]
        parts.append(torch.stack([tail.amin(dim=-3), tail.amax(dim=-3)], dim=-2).unsqueeze(-4))
    if not parts:
        return kf.new_empty(*lead, 0, H, 2, D)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-4)


def score_bound(q: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """Upper bound of q . k over each page's keys. q: [H, g, D] (g query heads per KV head);
    summaries: [n, H, 2, D] -> [H, g, n] float32. max(q*kmax, q*kmin) = q- * kmin + q+ * kmax: one
    batched matmul of [q-, q+] against the (min, max) pairs, in place when ``summaries`` is a
    transposed view of a head-major [H, n, 2, D] buffer (the decode state keeps them so: no copy)."""
    qf = q.float()
    H, n, D = summaries.shape[1], summaries.shape[0], summaries.shape[-1]
    pairs = summaries.transpose(0, 1).reshape(H, n, 2 * D)  # a view for head-major buffers
    return torch.bmm(torch.cat([qf.clamp(max=0), qf.clamp(min=0)], dim=-1), pairs.transpose(1, 2))


def group_max(scores: torch.Tensor, per: int) -> torch.Tensor:
    """[..., n] -> [..., ceil(n / per)]: the max over each group of ``per`` consecutive entries."""
    n = scores.shape[-1]
    pad = -n % per
    if pad:
        scores = torch.cat([scores, scores.new_full((*scores.shape[:-1], pad), -torch.inf)], dim=-1)
    return scores.unflatten(-1, (-1, per)).amax(-1)


def group_sum(values: torch.Tensor, per: int) -> torch.Tensor:
    """[..., n] -> [..., ceil(n / per)]: the sum over each group of ``per`` consecutive entries."""
    n = values.shape[-1]
    pad = -n % per
    if pad:
        values = torch.cat([values, values.new_zeros((*values.shape[:-1], pad))], dim=-1)
    return values.unflatten(-1, (-1, per)).sum(-1)


def top_pages(scores: torch.Tensor, budget: int, sink: int, local: int) -> torch.Tensor:
    """Pages to read per head: the first ``sink`` and last ``local`` pages always, then the best
    scored up to ``budget`` pages in all. scores: [H, n] -> ascending page ids [H, min(budget, n)]
    (the same count for every head)."""
    H, n = scores.shape
    if budget >= n:
        return torch.arange(n, device=scores.device).expand(H, n)
    sink, local_from = min(sink, n), max(n - local, 0)
    s = scores.float().clone()  # forced pages score +inf (slices: no mask tensor, no host sync)
    s[:, :sink] = torch.inf
    s[:, local_from:] = torch.inf
    k = max(budget, sink + n - max(local_from, sink))
    return s.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def pages_to_positions(pages: torch.Tensor, page: int, length: int) -> torch.Tensor:
    """Token positions of the given pages, clipped to ``length``. pages: [H, k] ascending ->
    [H, m] (every head's last page must be the sequence's last one or all pages full, so that
    rows keep one length: :func:`top_pages` guarantees it with ``local >= 1``)."""
    pos = (pages[..., None] * page + torch.arange(page, device=pages.device)).flatten(-2)
    # only the sequence's last page can be partial, and it is every head's last when chosen
    cut = -length % page if pages.shape[-1] and -(-length // page) - 1 == int(pages[0, -1]) else 0
    return pos[:, : pos.shape[-1] - cut]
