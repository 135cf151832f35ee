"""Native disk reads straight into the KV pool (kernels/chunk_io.cpp): the same bytes and the same
verdicts as the Python reads, for padded extents, both crc32 implementations, damaged and cut-short
files; and a paged CPU restore really takes them."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_loopkv.cache import segment_file
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.segment_record import SegmentRecord
from sgl_loopkv.kernels import chunk_io
from tests.restores import C, disk_source, restore, run_prefill, stored_segment

native = chunk_io.load()
pytestmark = pytest.mark.skipif(native is None, reason="no C++ compiler for the chunk_io extension")


def stored(tmp_path, geo: KVGeometry, chunks: int, group: int, seed: int = 0):
    store = DiskSegmentStore(tmp_path, 1 << 30, geo, layer_group=group)
    kv = torch.randn(
        geo.num_layers, 2, chunks * C, geo.num_kv_heads, geo.head_dim, generator=torch.Generator().manual_seed(seed)
    )
    rec = SegmentRecord(f"s{seed}", None, 0, chunks, 0)
    store.write(rec, kv, key_summaries(kv[:, 0], C))
    return store, rec, kv


def pool(geo: KVGeometry, pages: int = 64):
    return [torch.full((pages * C, geo.num_kv_heads, geo.head_dim), float("nan")) for _ in range(geo.num_layers)]


@pytest.mark.parametrize("crc", ["zlib-ng", "zlib"])
@pytest.mark.parametrize("head_dim", [8, 5], ids=["exact", "padded"])  # 5: a 640-byte chunk padded to 1024
def test_reads_land_in_their_pages_with_the_python_reads_verdicts(tmp_path, crc, head_dim):
    geo = KVGeometry(
        num_layers=6, num_kv_heads=1 if head_dim == 5 else 2, head_dim=head_dim, dtype=torch.float32, chunk_tokens=C
    )
    assert (geo.extent_bytes > C * geo.token_bytes_per_layer) == (head_dim == 5)
    store, rec, kv = stored(tmp_path, geo, chunks=10, group=3)
    path = store.path(rec.seg_id)
    fd, header = store.open_for_chunks(rec.seg_id)
    layout = store.codec.layout(header)
    raw = bytearray(path.read_bytes())
    raw[layout.extent_offset(4, 7) + 3] ^= 0x10  # chunk 7 of layer 4 damaged
    path.write_bytes(bytes(raw))
    if crc == "zlib":
        assert native.use_crc32("libz.so.1", "crc32", True)
    try:
        chunks, rows = [0, 1, 2, 5, 7, 9], range(3, 6)
        k, v = pool(geo), pool(geo)
        pages = torch.tensor([40, 3, 17, 9, 0, 63])
        before = store.codec.bytes_read
        bad = store.read_chunks_into(fd, header, rows, chunks, [k[x] for x in rows], [v[x] for x in rows], pages)
        assert store.codec.bytes_read - before == len(chunks) * len(rows) * geo.extent_bytes
        want_kv, want_bad = store.read_chunks(fd, rec.seg_id, header, rows, chunks)
        assert bad == want_bad == [[], [7], []]
        for r, layer in enumerate(rows):
            for i, j in enumerate(chunks):
                got_k, got_v = k[layer][pages[i] * C : (pages[i] + 1) * C], v[layer][pages[i] * C : (pages[i] + 1) * C]
                if j in bad[r]:
                    continue
                assert torch.equal(got_k, want_kv[r, 0, i]) and torch.equal(got_v, want_kv[r, 1, i])
                assert torch.equal(got_k, kv[layer, 0, j * C : (j + 1) * C])
        assert torch.isnan(k[0]).all() and torch.isnan(k[3][C : 3 * C]).all()  # nothing else written
    finally:
        chunk_io._choose_crc32(native)
        os.close(fd)


def test_a_cut_short_file_fails_only_the_extents_it_lost(tmp_path):
    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=C)
    store, rec, kv = stored(tmp_path, geo, chunks=6, group=4)
    fd, header = store.open_for_chunks(rec.seg_id)
    last = store.codec.layout(header).extent_offset(1, 5)
    os.truncate(store.path(rec.seg_id), last)  # chunk 5 keeps rows 0 only
    k, v = pool(geo), pool(geo)
    bad = store.read_chunks_into(fd, header, range(4), [4, 5], k, v, torch.tensor([1, 2]))
    assert bad == [[], [5], [5], [5]]
    assert torch.equal(k[2][C : 2 * C], kv[2, 0, 4 * C : 5 * C])
    os.close(fd)


def test_reads_that_cannot_go_to_the_pool_say_so(tmp_path):
    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=C)
    store, rec, _ = stored(tmp_path, geo, chunks=6, group=4)
    fd, header = store.open_for_chunks(rec.seg_id)
    k, v = pool(geo), pool(geo)
    pages = torch.tensor([1, 2])
    half = [x.half() for x in k]  # a pool of another dtype
    assert store.read_chunks_into(fd, header, range(4), [1, 2], half, half, pages) is None
    # two of a group's four rows: each read spans only the rows asked, so it could go there
    assert store.read_chunks_into(fd, header, range(1, 3), [1, 2], k[1:3], v[1:3], pages) == [[], []]
    os.close(fd)


def test_a_paged_cpu_restore_reads_natively(tmp_path, monkeypatch):
    """No Python read of an extent (``read_chunks``) in a paged restore on the CPU: every chunk came
    through the native reader, and the restore's checks of the layers' KV still hold."""
    from tests.restores import L, check_layer

    store, rec, kv = stored_segment(tmp_path, group=2)
    calls = []
    monkeypatch.setattr(segment_file.SegmentCodec, "read_chunks", lambda *a, **k: calls.append(a) or None)
    job, pk, pv = restore([disk_source(store, rec)], kv, budget=0.5, period=3, gate=2, disk=store, paged=True)
    run_prefill(job)
    job.settle()
    for layer in range(L):
        check_layer(job, pk, pv, kv, layer)
    st = job.account()
    assert calls == [] and st.disk_bytes_read == st.bytes_loaded > 0
    job.close()


def _whole(store, rec, chunk_lo: int, chunk_hi: int, python: bool, monkeypatch):
    """A whole read of chunks [chunk_lo, chunk_hi): native, or (``python``) the Python reads."""
    with monkeypatch.context() as m:
        if python:
            m.setattr(segment_file, "_chunk_io", lambda: None)
        return store.read(rec.seg_id, chunk_lo, chunk_hi)


@pytest.mark.parametrize(
    "dtype,group", [(torch.float32, 3), (torch.bfloat16, 4), (torch.int8, 3), (torch.int8, 5)], ids=str
)
def test_a_whole_read_lands_in_its_rows_as_the_python_read(tmp_path, monkeypatch, dtype, group):
    """The native whole read (each extent's pieces straight into the rows tensors: K and V values, an
    int8 tier's scales too; padded extents; groups that do not divide the layers) gives the Python
    read's rows bit for bit, for the whole segment and a chunk range, and is counted."""
    from sgl_loopkv.cache.quant import QuantKV

    geo = KVGeometry(num_layers=7, num_kv_heads=2, head_dim=8, dtype=dtype, chunk_tokens=C)
    store = DiskSegmentStore(tmp_path, 1 << 30, geo, layer_group=group)
    x = torch.randn(7, 2, 9 * C, 2, 8, generator=torch.Generator().manual_seed(3))
    kv = QuantKV.quantize(x) if dtype == torch.int8 else x.to(dtype)
    rec = SegmentRecord("w", None, 0, 9, 0)
    store.write(rec, kv, key_summaries(x[:, 0], C))
    for lo, hi in [(0, 9), (2, 7)]:
        before = (store.codec.bytes_read, store.codec.reads)
        got = _whole(store, rec, lo, hi, False, monkeypatch)
        assert store.codec.bytes_read - before[0] == 7 * (hi - lo) * geo.extent_bytes
        assert store.codec.reads > before[1]
        want = _whole(store, rec, lo, hi, True, monkeypatch)
        if dtype == torch.int8:
            assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
            assert torch.equal(got.q, kv.q[:, :, lo * C : hi * C]) and torch.equal(
                got.scale, kv.scale[:, :, lo * C : hi * C]
            )
        else:
            assert torch.equal(got, want) and torch.equal(got, kv[:, :, lo * C : hi * C])


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_whole_read_is_corrupt_at_the_row_the_python_read_names(tmp_path, monkeypatch, damage):
    from sgl_loopkv.cache.quant import QuantKV
    from sgl_loopkv.cache.segment_record import CorruptSegment

    geo = KVGeometry(num_layers=6, num_kv_heads=2, head_dim=8, dtype=torch.int8, chunk_tokens=C)
    store = DiskSegmentStore(tmp_path, 1 << 30, geo, layer_group=4)
    x = torch.randn(6, 2, 5 * C, 2, 8, generator=torch.Generator().manual_seed(4))
    rec = SegmentRecord("d", None, 0, 5, 0)
    store.write(rec, QuantKV.quantize(x), key_summaries(x[:, 0], C))
    path = store.path(rec.seg_id)
    fd, header = store.open_for_chunks(rec.seg_id)
    at = store.codec.layout(header).extent_offset(5, 3)
    os.close(fd)
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[at + 2 * C * 2 * 8 + 5] ^= 0x04  # a byte of a K scale of chunk 3, layer 5 (after its K and V values)
        path.write_bytes(bytes(raw))
    else:
        os.truncate(path, at + 7)
    messages = []
    for python in (False, True):
        with pytest.raises(CorruptSegment) as e:
            _whole(store, rec, 0, 5, python, monkeypatch)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "row 5" in messages[0]
