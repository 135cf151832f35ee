"""Segments with shared layer pairs (Krul) in the host and disk tiers: what comes back is what the
codec decodes, bit for bit, from either tier, whole or cut at a chunk boundary; the side data is
checksummed; stored bytes drop; a partial (recompute-skipping) disk read leaves the skipped
chunks out."""

from __future__ import annotations

import pytest
import torch

from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.packed import PackedKV
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES
from sgl_loopkv.krul.codec import CODECS

GEO = KVGeometry(num_layers=6, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)
PAIRS = [(1, 4), (2, 3)]


def segment(n_chunks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = n_chunks * GEO.chunk_tokens
    kv = torch.randn(GEO.num_layers, 2, t, GEO.num_kv_heads, GEO.head_dim, generator=g)
    kv[3] = kv[2] + 0.05 * torch.randn(kv[2].shape, generator=g)  # a similar pair
    rec = SegmentRecord(f"p{seed}", None, 0, n_chunks, 0, token_ids=list(range(t)))
    return rec, kv, key_summaries(kv[:, 0], GEO.chunk_tokens)


def expected(kv: torch.Tensor, codec: str) -> torch.Tensor:
    out = kv.clone()
    for a, b in PAIRS:
        row, side = CODECS.create(codec).encode(kv[a], kv[b])
        out[a], out[b] = CODECS.create(codec).decode(row, side)
    return out


@pytest.mark.parametrize("codec", ["reuse", "minicache"])
def test_pack_unpack_matches_the_codec_and_keeps_unpaired_layers(codec):
    _, kv, _ = segment(3, 1)
    packed = PackedKV.pack(kv, PAIRS, codec)
    assert packed.rows.shape[0] == GEO.num_layers - len(PAIRS)
    got = packed.unpack()
    assert torch.equal(got, expected(kv, codec))
    for layer in (0, 5):
        assert torch.equal(got[layer], kv[layer])
    if codec == "reuse":
        assert torch.equal(got[1], kv[1]) and torch.equal(got[4], kv[1])
    assert packed.nbytes < kv.numel() * kv.element_size()
    # cut at a chunk boundary == the same cut of the whole
    assert torch.equal(packed.slice_tokens(16, 48).unpack(), got[:, :, 16:48])


@pytest.mark.parametrize("sealed", [False, True])  # with --loopkv-lifecycle-disk-key-file: the side data sealed too
@pytest.mark.parametrize("codec", ["reuse", "minicache"])
def test_disk_roundtrip_of_a_packed_segment(tmp_path, codec, sealed):
    disk = DiskSegmentStore(tmp_path, 1 << 30, GEO, cipher=SegmentCipher(b"k" * 32) if sealed else None)
    rec, kv, summ = segment(4, 2)
    packed = PackedKV.pack(kv, PAIRS, codec)
    disk.write(rec, packed, summ)
    whole = disk.read(rec.seg_id, 0, 4)
    assert isinstance(whole, PackedKV) and torch.equal(whole.unpack(), packed.unpack())
    assert torch.equal(disk.read(rec.seg_id, 1, 3).unpack(), packed.unpack()[:, :, 16:48])
    assert torch.equal(disk.read_summaries(rec.seg_id), summ)
    plain = SegmentRecord("plain", None, 0, 4, 0, token_ids=rec.token_ids)
    disk.write(plain, kv, summ)
    assert rec.file_bytes < plain.file_bytes
    # a partial read: each layer from its own first chunk; a shared row from the earliest its layers need
    first = [2, 1, 3, 0, 4, 1]
    part = disk.read(rec.seg_id, 0, 4, first).unpack()
    full = packed.unpack()
    for layer in range(GEO.num_layers):
        need = min(first[m] for m in range(6) if packed.layer_rows[m] == packed.layer_rows[layer])
        assert torch.equal(part[layer, :, need * 16 :], full[layer, :, need * 16 :])
    # the side data is checksummed
    path = disk.path(rec.seg_id)
    data = bytearray(path.read_bytes())
    if codec == "minicache":
        data[-5] ^= 0x5A
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptSegment, match="side"):
            disk.read(rec.seg_id, 0, 4)


def test_store_serves_packed_segments_from_host_and_disk(tmp_path):
    rec, kv, summ = segment(4, 3)
    packed = PackedKV.pack(kv, PAIRS, "minicache")
    size = packed.nbytes + summ.numel() * 4
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), kv.numel() * 4 + summ.numel() * 4, tmp_path, 1 << 30)
    assert store.put(rec, packed, summ) and store.stats.host_bytes == size
    got, tier = store.fetch(rec.seg_id, 1, 4)
    assert tier == "host" and torch.equal(got.unpack(), packed.unpack()[:, :, 16:])
    store.flush()
    other = segment(4, 4)
    store.put(*other)  # too big for what is left: evicts the packed one from the host arena
    assert store.tier_of(rec.seg_id) == "disk"
    got, tier = store.fetch(rec.seg_id, 0, 2)
    assert tier == "disk" and torch.equal(got.unpack(), packed.unpack()[:, :, :32])
