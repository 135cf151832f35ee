"""int8 tiers (``--loopkv-tier-store-dtype int8``): the quantizer's error bound, and int8 segments in the
host and disk tiers: bit-identical round trips (whole, cut, partial), checksummed, under a third of
the fp32 bytes, packed layer pairs included."""

from __future__ import annotations

import pytest
import torch

from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.packed import PackedKV, quantize_rows
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES

GEO = KVGeometry(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.int8, chunk_tokens=16)


def segment(n_chunks: int, seed: int) -> tuple[SegmentRecord, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = n_chunks * GEO.chunk_tokens
    kv = torch.randn(GEO.num_layers, 2, t, GEO.num_kv_heads, GEO.head_dim, generator=g) * 3
    kv[1, 0, 5] = 0.0  # an all-zero token: scale 0, decodes to 0 (no NaN)
    rec = SegmentRecord(f"q{seed}", None, 0, n_chunks, 0, token_ids=list(range(t)))
    return rec, kv, key_summaries(kv[:, 0], GEO.chunk_tokens)


def same(a: QuantKV, b: QuantKV) -> bool:
    return torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


def test_quantize_error_is_within_half_a_step():
    _, kv, _ = segment(2, 0)
    qkv = QuantKV.quantize(kv)
    assert qkv.q.dtype == torch.int8 and qkv.scale.shape == kv.shape[:-1]
    for r in range(kv.shape[0]):
        err = (qkv[r] - kv[r]).abs()
        assert torch.all(err <= qkv.scale[r][..., None] / 2 + 1e-6)
    assert torch.equal(qkv[1][0, 5], torch.zeros_like(kv[1, 0, 5]))
    assert torch.equal(qkv.keys(), torch.stack([qkv[r][0] for r in range(kv.shape[0])]))
    # per token and head: one token's scale does not depend on another token
    assert same(qkv.slice_tokens(16, 32), QuantKV.quantize(kv[:, :, 16:32]))


def test_int8_tier_bytes_are_under_a_third_of_fp32():
    fp32 = KVGeometry(30, 3, 64, torch.float32, 16)
    int8 = KVGeometry(30, 3, 64, torch.int8, 16)
    assert int8.token_bytes_per_layer == 2 * 3 * (64 + 4)
    assert int8.extent_bytes == 13 * 512  # 6528 bytes sector-padded, not two 4 KiB pages (8192)
    assert fp32.extent_bytes / int8.extent_bytes > 3.6
    _, kv, _ = segment(2, 1)
    assert QuantKV.quantize(kv).nbytes * 3.7 < kv.numel() * 4


def test_disk_roundtrip_is_bit_identical_and_checksummed(tmp_path):
    disk = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(4, 2)
    qkv = QuantKV.quantize(kv)
    disk.write(rec, qkv, summ)
    assert same(disk.read(rec.seg_id, 0, 4), qkv)
    assert same(disk.read(rec.seg_id, 1, 3), qkv.slice_tokens(16, 48))
    first = [2, 0, 3, 1]  # a partial read: layer l from chunk first[l]; the skipped chunks are left zero
    part = disk.read(rec.seg_id, 0, 4, first)
    for layer, f in enumerate(first):
        assert torch.equal(part[layer][:, 16 * f :], qkv[layer][:, 16 * f :])
        assert not part[layer][:, : 16 * f].any()
    path = disk.path(rec.seg_id)
    data = bytearray(path.read_bytes())
    data[-summ.numel() * 2 - 100] ^= 0xFF  # inside the last extent (its scales); summaries are fp16
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptSegment):
        disk.read(rec.seg_id, 0, 4)


def test_packed_pairs_with_int8_rows_roundtrip(tmp_path):
    disk = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(3, 3)
    packed = quantize_rows(PackedKV.pack(kv, [(1, 2)], "minicache"))
    assert isinstance(packed.rows, QuantKV) and packed.rows.shape[0] == 3
    disk.write(rec, packed, summ)
    back = disk.read(rec.seg_id, 0, 3)
    assert isinstance(back, PackedKV) and torch.equal(back.unpack(), packed.unpack())
    assert torch.equal(back.slice_tokens(16, 32).unpack(), packed.unpack()[:, :, 16:32])
    torch.testing.assert_close(packed.unpack()[0], kv[0], atol=0.05, rtol=0.02)  # unpaired layer: int8 only


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_store_serves_int8_segments_from_either_tier(tmp_path, tier):
    store = TieredKVStore(
        GEO,
        VALUE_POLICIES.create("lru"),
        host_quota_bytes=0 if tier == "disk" else 1 << 30,
        disk_dir=tmp_path,
        disk_quota_bytes=1 << 30,
    )
    rec, kv, summ = segment(4, 4)
    qkv = QuantKV.quantize(kv)
    assert store.put(rec, qkv, summ)
    store.flush()
    got, where = store.fetch(rec.seg_id, 1, 4)
    assert where == tier and same(got, qkv.slice_tokens(16, 64))
    if tier == "disk":  # promoted to the host arena? (quota 0: no) -- summaries come from the decoded keys
        assert store.tier_of(rec.seg_id) == "disk"
    assert store.stats.host_bytes <= (1 << 30)
    store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["kv_load kernel", "torch blocks"])
def test_the_loader_decodes_int8_into_the_same_pool_values(native, dtype):
    """The loader decodes an int8 layer inside its copy (the kv_load kernel) or, without it, a block
    at a time into one reused buffer: either way every slot gets exactly ``q * scale`` (what
    torch.mul gives for the whole layer) in the pool's dtype, across block edges, with a different
    front recomputed (skipped) per layer, and nothing leaks between parts."""
    from sgl_loopkv.cache.loader import DECODE_BLOCK, LayerwiseLoader, LoadPart
    from sgl_loopkv.kernels import kv_load

    if native and kv_load.load() is None:
        pytest.skip("no compiler for the kv_load kernel here")

    T, L, H, D = DECODE_BLOCK * 2 + 37, GEO.num_layers, GEO.num_kv_heads, GEO.head_dim
    g = torch.Generator().manual_seed(5)
    parts, refs = [], []
    k = [torch.full((3 * T, H, D), float("nan"), dtype=dtype) for _ in range(L)]
    v = [torch.full((3 * T, H, D), float("nan"), dtype=dtype) for _ in range(L)]
    slots = torch.randperm(3 * T, generator=g)
    for i, n in enumerate((T, 16)):  # a long part, then a short one reusing the buffer
        qkv = QuantKV.quantize(torch.randn(L, 2, n, H, D, generator=g) * 3)
        skip = (0, 16, DECODE_BLOCK, min(n, DECODE_BLOCK + 48))[:L]
        parts.append(LoadPart(qkv, slots[i * T : i * T + n], skip))
        refs.append((qkv, slots[i * T : i * T + n], skip))
    decoded = []
    loader = LayerwiseLoader(k, v, synchronous=True, on_copy=lambda n, d, c: decoded.append((n, d, c)))
    assert (loader._kv_load is not None) == native or not native
    if not native:
        loader._kv_load = None
    loader.submit(parts)
    for qkv, sl, skip in refs:
        for layer in range(L):
            want = torch.mul(qkv.q[layer], qkv.scale[layer].unsqueeze(-1)).to(dtype)
            s = skip[layer]
            assert torch.equal(k[layer][sl[s:]], want[0, s:]) and torch.equal(v[layer][sl[s:]], want[1, s:])
            assert torch.isnan(k[layer][sl[:s]]).all()  # the recomputed front is left to the restorer
    want_bytes = sum(2 * (len(sl) - s) * H * D * dtype.itemsize for _, sl, skip in refs for s in skip if s < len(sl))
    assert sum(n for n, _, _ in decoded) == want_bytes and all(d >= 0 and c >= 0 for _, d, c in decoded)
    assert len(decoded) == (1 if native else L)  # synchronous + native: every layer in one threaded call
