"""Whole reads' rows in reused memory (sgl_loopkv/cache/read_buffers.py): a buffer comes back only
once no tensor uses it, whatever view outlived the rows it was handed out as; what the pool keeps free
stays bounded; a whole read through the codec reuses the last one's memory and gives the same rows."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from sgl_loopkv.cache import read_buffers
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.read_buffers import ReadBuffers
from sgl_loopkv.cache.segment_record import SegmentRecord
from sgl_loopkv.cache.write_through import WriteThrough

MB = 1 << 20


def test_a_buffer_comes_back_only_when_no_tensor_uses_it():
    pool = ReadBuffers(keep_bytes=64 * MB)
    a = pool.empty((3 * MB,), torch.uint8)
    b = pool.empty((3 * MB,), torch.uint8)  # a is in use: other memory
    assert a.data_ptr() != b.data_ptr()
    kept = a[MB:].view(torch.int32)  # a view outlives the rows it was taken from
    ptr = a.data_ptr()
    del a
    c = pool.empty((3 * MB,), torch.uint8)
    assert c.data_ptr() not in (ptr, b.data_ptr())
    kept.fill_(7)  # still its own memory
    del kept
    d = pool.empty((3 * MB,), torch.uint8)
    assert d.data_ptr() == ptr  # free now: reused
    assert pool.held_bytes == 3 * 4 * MB  # three buffers, each rounded up to 2 MB steps


def test_the_rows_have_the_asked_shape_and_dtype_and_alignment():
    pool = ReadBuffers(keep_bytes=64 * MB)
    shapes = [((7, 2, 480, 2, 64), torch.bfloat16), ((7, 2, 4800, 2), torch.float32), ((5, 3), torch.int8)]
    for shape, dtype in shapes:
        x = pool.empty(shape, dtype)
        assert x.shape == shape and x.dtype == dtype and x.is_contiguous() and x.data_ptr() % 64 == 0
        x.fill_(1)


def test_free_buffers_stay_within_the_bound():
    pool = ReadBuffers(keep_bytes=8 * MB)
    rows = [pool.empty((4 * MB,), torch.uint8) for _ in range(4)]  # 16 MB in use: kept while used
    assert pool.held_bytes == 16 * MB and pool.free_bytes == 0
    del rows
    assert pool.free_bytes == 16 * MB
    pool.trim()
    assert pool.free_bytes == pool.held_bytes == 8 * MB


def test_a_small_read_does_not_take_a_large_buffer_and_a_large_one_is_not_kept():
    pool = ReadBuffers(keep_bytes=16 * MB)
    big = pool.empty((12 * MB,), torch.uint8)
    ptr = big.data_ptr()
    del big
    small = pool.empty((MB,), torch.uint8)
    assert small.data_ptr() != ptr
    huge = pool.empty((32 * MB,), torch.uint8)  # over the bound: an ordinary tensor
    tiny = pool.empty((MB // 2,), torch.uint8)  # under a megabyte: one too
    assert pool.held_bytes == 14 * MB and huge.numel() == 32 * MB and tiny.numel() == MB // 2


def test_threads_never_share_a_buffer_in_use():
    pool = ReadBuffers(keep_bytes=32 * MB)
    errors = []

    def work(k: int):
        for i in range(40):
            x = pool.empty((MB,), torch.uint8)
            x.fill_(k)
            if not bool((x == k).all()):
                errors.append((k, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_a_whole_read_reuses_the_last_reads_memory_once_it_is_dropped(tmp_path, dtype):
    geo = KVGeometry(num_layers=6, num_kv_heads=2, head_dim=64, dtype=dtype, chunk_tokens=16)
    store = DiskSegmentStore(tmp_path, 1 << 30, geo)
    x = torch.randn(6, 2, 64 * 16, 2, 64, generator=torch.Generator().manual_seed(0))
    kv = QuantKV.quantize(x) if dtype == torch.int8 else x.to(dtype)
    store.write(SegmentRecord("s", None, 0, 64, 0), kv, key_summaries(x[:, 0], 16))

    def rows(t):
        return t.q if isinstance(t, QuantKV) else t

    def same(a, b):
        return torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) if isinstance(a, QuantKV) else torch.equal(a, b)

    first = store.read("s", 0, 64)
    assert same(first, kv)
    second = store.read("s", 0, 64)  # the first still held (as a promoted read is): other memory
    assert rows(second).data_ptr() != rows(first).data_ptr() and same(second, kv)
    ptr = rows(first).data_ptr()
    del first
    third = store.read("s", 0, 64)
    assert rows(third).data_ptr() == ptr and same(third, kv)
    assert store.codec.buffers.held_bytes > 0


def test_the_bound_is_the_environment_s(monkeypatch):
    assert read_buffers.KEEP_BYTES > 0
    assert ReadBuffers().keep_bytes == read_buffers.KEEP_BYTES


@pytest.mark.parametrize("quantized", [True, False], ids=["int8 tier", "float tier"])
def test_a_stores_gather_is_reused_memory_only_where_its_int8_form_is_what_is_kept(quantized):
    """The write-through's gather (on the scheduler thread): a quantized tier keeps only the int8 rows,
    so the gathered rows are a temporary in reused memory; a float tier keeps them in the arena."""
    layers, heads, dim, slots_n = 4, 2, 64, 4096
    g = torch.Generator().manual_seed(1)
    pool = SimpleNamespace(
        k_buffer=[torch.randn(8192, heads, dim, generator=g) for _ in range(layers)],
        v_buffer=[torch.randn(8192, heads, dim, generator=g) for _ in range(layers)],
    )
    store = SimpleNamespace(geometry=SimpleNamespace(quantized=quantized), buffers=ReadBuffers(keep_bytes=64 * MB))
    tree = SimpleNamespace(kv_pool=pool, geometry=SimpleNamespace(num_layers=layers), store=store)
    wt = WriteThrough(tree)
    slots = torch.randperm(8192, generator=g)[:slots_n]
    first = wt.gather(slots)
    assert torch.equal(first[2, 1], pool.v_buffer[2][slots]) and torch.equal(first[0, 0], pool.k_buffer[0][slots])
    ptr = first.data_ptr()
    del first
    second = wt.gather(slots)
    assert torch.equal(second[3, 0], pool.k_buffer[3][slots])
    if quantized:
        assert second.data_ptr() == ptr
    assert (store.buffers.held_bytes > 0) == quantized
