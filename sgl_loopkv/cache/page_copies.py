"""Copies of whole chunks into a chunk-pruned restore's page cache in the KV pool: functions over
tensors, for :class:`~sgl_loopkv.cache.chunk_loads.ChunkLoads`. A pool layer ``k_buf``/``v_buf`` is
[slots, H, D]; a page-cache place is ``c`` slots (one chunk), given as a row of ``to`` [n, c]."""

from __future__ import annotations

import torch

from sgl_loopkv.kernels import chunk_io


def host_chunks(kv: torch.Tensor, local: torch.Tensor, c: int) -> torch.Tensor:
    """Chunks ``local`` (ascending) of a source's host KV ``kv`` at one layer: [2, n * c, H, D]."""
    lo, hi = int(local[0]), int(local[-1])
    if hi - lo == len(local) - 1:  # one run (budget 1.0: all of them): a view
        return kv[:, lo * c : (hi + 1) * c]
    # whole chunks, not token rows: half the time of a gather by token index
    return kv.unflatten(1, (-1, c)).index_select(1, local).flatten(1, 2)


def copy_host_native(
    x: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, local: torch.Tensor, to: torch.Tensor, c: int
) -> bool:
    """Copy chunks ``local`` (ascending) of a source's host KV ``x`` [2, T, H, D] straight into
    their pool pages ``to`` [n, c] (aligned pool pages), natively: one memcpy per chunk's K or V
    rows, no gathered temporary, no GIL (gathering then copying took twice as long, on the cores the
    forward runs on). False when they cannot go that way (no native copier, a GPU pool, another
    dtype, rows not contiguous): the caller gathers and copies."""
    native = chunk_io.load()
    if native is None:
        return False
    H, D = k_buf.shape[1:]
    if not (
        x.device.type == k_buf.device.type == v_buf.device.type == "cpu"
        and x.dtype == k_buf.dtype == v_buf.dtype
        and x.shape[2:] == (H, D)
        and x.stride()[1:] == (H * D, D, 1)
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
    ):
        return False
    span = c * H * D * x.element_size()  # one chunk's K (or V) rows, in the pool and in x
    pages = to[:, 0].cpu() // c * span
    rows = local * span
    # raw addresses: every span inside its tensor, or no copy at all
    if int(local[-1] + 1) * c > x.shape[1] or int(pages.max()) + span > k_buf.numel() * k_buf.element_size():
        raise IndexError(f"chunks {int(local[-1])} / pages {int(pages.max()) // span} out of range")
    v_src = x.data_ptr() + x.stride(0) * x.element_size()
    spans = torch.cat(
        (
            torch.stack((k_buf.data_ptr() + pages, x.data_ptr() + rows), dim=1),
            torch.stack((v_buf.data_ptr() + pages, v_src + rows), dim=1),
        )
    )
    native.copy_spans(spans, span)
    return True


def pages_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, pages: torch.Tensor, c: int) -> torch.Tensor:
    """Chunks read into pool ``pages`` of one layer, as a read returns them: [2, n, c, H, D] (a copy)."""
    return torch.stack([b.view(-1, c, *b.shape[1:])[pages] for b in (k_buf, v_buf)])


def put_chunks(
    k_buf: torch.Tensor, v_buf: torch.Tensor, kv: torch.Tensor, to: torch.Tensor, c: int, paged: bool
) -> None:
    """Copy chunks ``kv`` [2, n, c, H, D] (any strides: a view of the read buffer) into the pool
    slots ``to`` [n, c] of one layer: one copy per K and V, page by page when the page cache's
    places are aligned pool pages (``paged``), else slot by slot."""
    if paged:
        pages = (to[:, 0] // c).to(k_buf.device)
        for buf, x in ((k_buf, kv[0]), (v_buf, kv[1])):
            buf.view(-1, c, *buf.shape[1:]).index_copy_(0, pages, x.to(buf.device, buf.dtype))
        return
    to = to.flatten().to(k_buf.device)
    k_buf.index_copy_(0, to, kv[0].reshape(-1, *k_buf.shape[1:]).to(k_buf.device, k_buf.dtype))
    v_buf.index_copy_(0, to, kv[1].reshape(-1, *v_buf.shape[1:]).to(v_buf.device, v_buf.dtype))
