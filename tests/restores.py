"""A chunk-pruned restore over a fake KV pool (CPU or CUDA), its stored history and the checks
that what every layer attends to is exactly the stored KV of its kept chunks: shared by the
pruned-restore, chunk-cache and GPU tier-copy tests (no hypothesis: the GPU image may lack it)."""

from __future__ import annotations

import torch

from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.pruned import ChunkReader, KVBuffers, PrunedHistory, PrunedParams, PrunedRestore, Source
from sgl_loopkv.cache.segment_record import SegmentRecord

C, H, D, L = 16, 2, 8, 6
GEO = KVGeometry(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32, chunk_tokens=C)


def kv_of(seed: int, chunks: int) -> torch.Tensor:
    return torch.randn(L, 2, chunks * C, H, D, generator=torch.Generator().manual_seed(seed))


def restore(
    sources, kv_total, budget=0.5, period=3, gate=1, disk=None, prefetch=1.0, selection="chunks", device="cpu",
    reader=None, paged=False,
):  # fmt: skip
    """A restore of ``kv_total``'s history into a NaN-filled pool of 4096 slots on ``device``,
    its page cache scattered over it: slot by slot, or (``paged``) as whole aligned pool pages in
    random order, as SGLang's paged allocator hands them out (reads are copied page by page)."""
    m = kv_total.shape[2] // C
    pool_k = [torch.full((4096, H, D), float("nan"), device=device) for _ in range(L)]
    pool_v = [torch.full((4096, H, D), float("nan"), device=device) for _ in range(L)]
    summaries = key_summaries(kv_total[:, 0], C)[::period]  # each period's first layer
    job = PrunedRestore(
        PrunedHistory("r", sources, m, 0, summaries), KVBuffers(pool_k, pool_v), reader or ChunkReader(),
        PrunedParams(C, budget, period, gate, local=2, prefetch=prefetch, selection=selection), disk=disk,
    )  # fmt: skip
    if paged:
        pages = torch.randperm(4096 // C - 1)[: job.cache_tokens // C] + 1
        slots = (pages[:, None] * C + torch.arange(C)).flatten()
    else:
        slots = torch.randperm(4000)[: job.cache_tokens] + 10
    job.attach(slots.to(device))
    assert job.paged == paged
    return job, pool_k, pool_v


def check_layer(job, pk, pv, kv, layer):
    """What layer ``layer`` attends to is exactly the stored KV of its kept chunks (read on the
    current stream after the layer's wait, as the forward would)."""
    pos, slots = job.kept_positions(layer), job.kept_slots(layer)
    assert torch.equal(pk[layer][slots].cpu(), kv[layer, 0, pos]) and torch.equal(
        pv[layer][slots].cpu(), kv[layer, 1, pos]
    )
    return pos


def run_prefill(job, q_seed=1):
    q = torch.randn(5, 2 * H, D, generator=torch.Generator().manual_seed(q_seed)).to(job.k_buffers[0].device)
    for layer in range(L):
        if job.needs_selection(layer):
            job.select(layer, q, 0.3)
        job.wait(layer)


def decode_steps(job, steps, serial, seed=20):
    """Decode steps whose query drifts: every period re-selects (tau 2: always) and recalls."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        q = torch.randn(1, 2 * H, D, generator=g).to(job.k_buffers[0].device)
        for layer in range(L):
            if layer % job.period == 0:
                job.decode_select(layer, q, 0.3, tau=2.0, serial=serial)
            job.wait(layer)


def stored_segment(tmp_path, seed=2, chunks=12, group=8):
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO, layer_group=group)
    kv = kv_of(seed, chunks)
    rec = SegmentRecord(f"s{seed}", None, 0, chunks, 0)
    store.write(rec, kv, key_summaries(kv[:, 0], C))
    return store, rec, kv


def disk_source(store, rec, lo=0, hi=None, first=0):
    fd, header = store.open_for_chunks(rec.seg_id)
    return Source(rec.seg_id, lo, hi if hi is not None else rec.n_chunks, first, fd=fd, header=header)
