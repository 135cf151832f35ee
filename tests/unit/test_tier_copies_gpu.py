"""The tier threads' host-to-device copies into a CUDA pool (``sgl_loopkv/cache/copy_stream.py``):
the layer loader and the chunk reader copy on a stream of their own; the forward's stream waits per
layer on their events, and their copies come after the forward work queued when they were
submitted. The tests keep a stream busy (``torch.cuda._sleep``) so that a missing wait shows as
stale, NaN or misplaced KV rather than passing by luck. CUDA only (skipped elsewhere)."""

from __future__ import annotations

import threading

import pytest
import torch

from sgl_loopkv.cache.copy_stream import CopyStream
from sgl_loopkv.cache.loader import LayerwiseLoader, LoadPart
from sgl_loopkv.cache.pruned import ChunkReader, Source
from tests.restores import (
    D,
    H,
    L,
    check_layer,
    decode_steps,
    disk_source,
    kv_of,
    restore,
    run_prefill,
    stored_segment,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SLEEP = 200_000_000  # GPU cycles: ~0.1 s on an H100


@pytest.mark.parametrize("forward_waits", [True, False])
def test_copies_and_forward_meet_at_events(forward_waits):
    """A copy waits for the forward's earlier read of its slots; the forward's next read waits for
    the copy. Control (``forward_waits`` False): without the wait the forward reads the old bytes,
    so the first case can fail."""
    copies, fwd = CopyStream("cuda"), torch.cuda.Stream()
    buf = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(SLEEP)
        before = buf.clone()  # queued before the copy is submitted: must not see it
        after = copies.submitted()
    done = {}

    def copy():
        with copies.copying(after):
            torch.cuda._sleep(SLEEP // 2)  # a slow copy
            buf.fill_(1.0)
            done["event"] = copies.copied()

    t = threading.Thread(target=copy)
    t.start()
    t.join()
    with torch.cuda.stream(fwd):
        if forward_waits:
            CopyStream.wait(done["event"])
        now = buf.clone()
    torch.cuda.synchronize()
    assert float(before.abs().max()) == 0.0
    assert float(now.min()) == (1.0 if forward_waits else 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_loader_fills_a_cuda_pool_behind_a_busy_forward(dtype):
    """Slots computed on a busy forward stream, KV copied by the loader thread, each layer read on
    the forward stream right after its wait: exactly the host KV (in the pool's dtype)."""
    T = 300
    kv = torch.randn(L, 2, T, H, D)
    k = [torch.full((4096, H, D), float("nan"), device="cuda", dtype=dtype) for _ in range(L)]
    v = [torch.full((4096, H, D), float("nan"), device="cuda", dtype=dtype) for _ in range(L)]
    loader = LayerwiseLoader(k, v)
    fwd = torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(SLEEP)
        slots = torch.randperm(4096, device="cuda")[:T]  # ready only after the sleep
        loader.submit([LoadPart(kv, slots, skip=tuple(range(0, 6 * L, 6)))])
        got = []
        for layer in range(L):
            loader.wait_until(layer)
            got.append((k[layer][slots].clone(), v[layer][slots].clone()))
    torch.cuda.synchronize()
    for layer, (gk, gv) in enumerate(got):
        skip = 6 * layer  # the recomputed front stays untouched
        assert torch.isnan(gk[:skip].float()).all()
        assert torch.equal(gk[skip:].cpu(), kv[layer, 0, skip:].to(dtype))
        assert torch.equal(gv[skip:].cpu(), kv[layer, 1, skip:].to(dtype))
    loader.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pruned_restore_into_a_cuda_pool_behind_a_busy_forward(tmp_path, tier):
    """A chunk-pruned restore whose forward runs on its own, busy stream (queries, slot lists and
    selections on the GPU): every layer attends to exactly its kept chunks' stored KV."""
    if tier == "disk":
        store, rec, kv = stored_segment(tmp_path, seed=12, chunks=20, group=2)
        sources, disk = [disk_source(store, rec)], store
    else:
        kv, disk = kv_of(12, 20), None
        sources = [Source("s", 0, 20, 0, host_kv=kv)]
    fwd = torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(SLEEP)
        job, pk, pv = restore(sources, kv, budget=0.3, period=3, gate=1, disk=disk, device="cuda")
        run_prefill(job)
        for layer in range(L):
            check_layer(job, pk, pv, kv, layer)
    assert job.stats.bytes_loaded > 0 and job.stats.bad_extents == 0
    job.close()


def test_decode_recall_into_a_cuda_pool_overlapped_equals_serial(tmp_path):
    """FreeKV recalls rewrite page-cache places an earlier step's attention read: the reader's
    copies wait for that forward work, and overlapped recalls leave what serial ones leave."""
    store, rec, kv = stored_segment(tmp_path, seed=11, chunks=24)
    reader, fwd, jobs = ChunkReader(), torch.cuda.Stream(), []
    with torch.cuda.stream(fwd):
        for serial in (False, True):
            job, pk, pv = restore(
                [disk_source(store, rec)], kv, budget=0.25, period=2, disk=store, device="cuda", reader=reader
            )
            run_prefill(job)
            torch.cuda._sleep(SLEEP)  # the step's attention still queued when the recalls are submitted
            decode_steps(job, 4, serial)
            job._flush_recalls(skip=None)
            for layer in range(L):
                job.wait(layer)
                check_layer(job, pk, pv, kv, layer)
            assert job.stats.recalled_bytes > 0
            jobs.append(job)
    for layer in range(L):
        assert torch.equal(jobs[0].kept_positions(layer), jobs[1].kept_positions(layer))
    for job in jobs:
        job.close()
    reader.close()
