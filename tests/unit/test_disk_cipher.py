"""Encryption at rest of the disk tier (issue 55, part 4): the key file's checks, sealed segment files
that round-trip and hold no plaintext token ids, and a wrong key, a flipped byte or a moved extent
read as a corrupt segment (the history is recomputed), never as an error or wrong KV."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from sgl_loopkv.cache.address import chunk_chain
from sgl_loopkv.cache.cipher import KeyFileError, SegmentCipher, load_key
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, SegmentFileLayout, key_summaries
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES

GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)
CHUNKS = 4
TOKENS = [40_000 + 7 * i for i in range(CHUNKS * GEO.chunk_tokens)]  # values no KV byte pattern hits by chance


def segment(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(GEO.num_layers, 2, len(TOKENS), GEO.num_kv_heads, GEO.head_dim, generator=g)
    hashes = chunk_chain(TOKENS, GEO.chunk_tokens, bytes(16))
    rec = SegmentRecord(f"s{seed}", None, 0, CHUNKS, 0, token_ids=list(TOKENS), chunk_hashes=hashes)
    return rec, kv, key_summaries(kv[:, 0], GEO.chunk_tokens)


def token_patterns() -> list[bytes]:
    """Ways the token ids could sit in a file: the header's JSON list, int32 and int64 arrays."""
    run = TOKENS[:8]
    return [", ".join(map(str, run)).encode(), struct.pack("<8i", *run), struct.pack("<8q", *run)]


def cipher(seed: int = 1) -> SegmentCipher:
    return SegmentCipher(bytes([seed]) * 32)


def written(tmp_path, c: SegmentCipher | None, seed: int = 0):
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO, cipher=c)
    rec, kv, summ = segment(seed)
    store.write(rec, kv, summ)
    return store, rec, kv, summ


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# --- the key file ------------------------------------------------------------------------------
def key_file(tmp_path, data: bytes, mode: int = 0o600):
    p = tmp_path / "key"
    p.write_bytes(data)
    p.chmod(mode)
    return p


def test_key_file_raw_or_hex(tmp_path):
    key = os.urandom(32)
    assert load_key(key_file(tmp_path, key)) == key
    assert load_key(key_file(tmp_path, key.hex().encode() + b"\n")) == key


@pytest.mark.parametrize(
    ("data", "mode", "says"),
    [
        (b"x" * 31, 0o600, "holds 31 bytes"),
        (b"ab" * 33, 0o600, "holds 66 bytes"),
        (b"zz" * 32, 0o600, "64 hex digits"),  # 64 characters, not hex
        (os.urandom(32), 0o640, "chmod 600"),
        (os.urandom(32), 0o604, "readable by group or others"),
    ],
)
def test_bad_key_files_are_refused_without_showing_the_key(tmp_path, data, mode, says):
    with pytest.raises(KeyFileError, match=says) as e:
        load_key(key_file(tmp_path, data, mode))
    assert data.hex() not in str(e.value) and repr(data) not in str(e.value)


def test_missing_or_unreadable_key_file(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read the key file"):
        load_key(tmp_path / "nope")
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_key(tmp_path)
    if os.geteuid() != 0:  # root reads a 0000 file anyway
        with pytest.raises(KeyFileError, match="cannot read the key file"):
            load_key(key_file(tmp_path, os.urandom(32), 0o000))


def test_cipher_repr_names_no_key():
    c = SegmentCipher(b"k" * 32)
    assert "kkkk" not in repr(c) and b"k".hex() * 4 not in repr(c) and c.key_id in repr(c)
    assert SegmentCipher(b"j" * 32).key_id != c.key_id


# --- sealed files ------------------------------------------------------------------------------
def test_sealed_round_trip(tmp_path):
    store, rec, kv, summ = written(tmp_path, cipher())
    assert torch.equal(store.read(rec.seg_id, 0, CHUNKS), kv)
    assert torch.equal(store.read(rec.seg_id, 1, 3), kv[:, :, 16:48])
    assert torch.equal(store.read_summaries(rec.seg_id), summ.to(GEO.summary_dtype))
    fd, header = store.open_for_chunks(rec.seg_id)
    try:
        assert header["token_ids"] == TOKENS and header["cipher"] == "aes-256-gcm"
        assert store.read_chunks_into(fd, header, range(3), [1], [], [], torch.tensor([0])) is None  # no native read
        got, bad = store.read_chunks(fd, rec.seg_id, header, range(3), [0, 2])
        assert bad == [[], [], []]
        want = kv.view(3, 2, CHUNKS, 16, 2, 8)[:, :, [0, 2]]
        assert torch.equal(got, want)
        summaries = store.codec.read_summaries(fd, rec.seg_id, [2], header)
        assert torch.equal(summaries, summ[[2]].to(GEO.summary_dtype))
    finally:
        os.close(fd)
    found = store.find(rec.chunk_hashes, 1)  # a lookup through a chunk link reads the sealed header
    assert found is not None and (found.lo, found.hi) == (1, CHUNKS) and found.record.token_ids == TOKENS


def test_no_plaintext_token_ids_in_sealed_files(tmp_path):
    plain, rec, _, _ = written(tmp_path / "plain", None)
    raw = plain.path(rec.seg_id).read_bytes()
    assert all(p in raw for p in token_patterns()[:1])  # the check can fail: a plain header holds them
    sealed, rec, kv, _ = written(tmp_path / "sealed", cipher())
    raw = sealed.path(rec.seg_id).read_bytes()
    assert not any(p in raw for p in token_patterns())
    assert b"token_ids" not in raw and b"chunk_hashes" not in raw  # the whole header is sealed
    assert kv[0, 0, 0].numpy().tobytes() not in raw  # and so is the KV


@pytest.mark.parametrize("reader", ["other key", "no key"])
def test_another_key_or_none_reads_a_corrupt_segment(tmp_path, reader):
    store, rec, _, _ = written(tmp_path, cipher(1))
    other = DiskSegmentStore(tmp_path, 1 << 30, GEO, cipher=cipher(2) if reader == "other key" else None)
    with pytest.raises(CorruptSegment):
        other.read_header(rec.seg_id)
    with pytest.raises(CorruptSegment):
        other.read(rec.seg_id, 0, CHUNKS)
    assert other.probe(rec.chunk_hashes, 0) is None  # a lookup misses: the history is recomputed


def test_a_sealed_store_reads_plain_files_as_corrupt(tmp_path):
    _, rec, _, _ = written(tmp_path, None)
    with pytest.raises(CorruptSegment, match="plain file"):
        DiskSegmentStore(tmp_path, 1 << 30, GEO, cipher=cipher()).read_header(rec.seg_id)


def _layout(store, seg_id) -> SegmentFileLayout:
    return store.codec.layout(store.read_header(seg_id))


def test_flipped_byte_in_header_extent_or_summary(tmp_path):
    c = cipher()
    store, rec, _, _ = written(tmp_path, c)
    path, layout = store.path(rec.seg_id), _layout(store, rec.seg_id)
    pristine = path.read_bytes()
    for offset, part in [
        (100, "header"),
        (layout.extent_offset(1, 2) + 5, "extent"),
        (layout.summary_offset + 3, "summary"),
    ]:
        path.write_bytes(pristine)
        flip(path, offset)
        if part == "header":  # the preamble's crc32 is over the sealed bytes: rewrite it to reach the tag
            data = bytearray(path.read_bytes())
            hlen = struct.unpack("<I", data[8:12])[0]
            from zlib import crc32

            data[12:16] = struct.pack("<I", crc32(bytes(data[16 : 16 + hlen])))
            path.write_bytes(bytes(data))
            with pytest.raises(CorruptSegment, match="does not decrypt"):
                store.read_header(rec.seg_id)
            continue
        with pytest.raises(CorruptSegment):
            if part == "extent":
                store.read(rec.seg_id, 0, CHUNKS)
            else:
                store.read_summaries(rec.seg_id)
        if part == "extent":  # a chunk read names exactly the damaged chunk of the damaged row
            fd, header = store.open_for_chunks(rec.seg_id)
            try:
                _, bad = store.read_chunks(fd, rec.seg_id, header, range(3), [0, 1, 2, 3])
            finally:
                os.close(fd)
            assert bad == [[], [2], []]


def test_extents_cannot_be_swapped(tmp_path):
    """Two extents exchanged in place: each is intact ciphertext, but bound to its own place."""
    store, rec, _, _ = written(tmp_path, cipher())
    path, layout = store.path(rec.seg_id), _layout(store, rec.seg_id)
    data, eb = bytearray(path.read_bytes()), GEO.extent_bytes
    a, b = layout.extent_offset(0, 0), layout.extent_offset(0, 1)
    data[a : a + eb], data[b : b + eb] = data[b : b + eb], data[a : a + eb]
    path.write_bytes(bytes(data))
    fd, header = store.open_for_chunks(rec.seg_id)
    try:
        _, bad = store.read_chunks(fd, rec.seg_id, header, range(3), [0, 1, 2, 3])
    finally:
        os.close(fd)
    assert bad == [[0, 1], [], []]


def test_delete_and_expire_read_sealed_headers(tmp_path):
    store, rec, _, _ = written(tmp_path, cipher())
    assert len(list((tmp_path / "chunks").iterdir())) == CHUNKS
    store.delete(rec.seg_id)  # its chunk links are found through its (sealed) header
    assert not list((tmp_path / "chunks").iterdir()) and not store.path(rec.seg_id).exists()
    store, rec, _, _ = written(tmp_path, cipher())
    os.utime(store.path(rec.seg_id), (1, 1))
    assert store.expire(60) == [rec.seg_id]


def test_wrong_key_store_recomputes(tmp_path):
    """The tiered store's disk read of a segment another key sealed: counted corrupt, forgotten, and
    the caller told (CorruptSegment: the tree recomputes that history)."""
    written(tmp_path, cipher(1))
    lost = []
    store = TieredKVStore(
        GEO,
        VALUE_POLICIES.create("lru"),
        host_quota_bytes=0,
        disk_dir=tmp_path,
        disk_quota_bytes=1 << 30,
        on_lost=lost.append,
        read_ahead=False,
        disk_cipher=cipher(2),
    )
    rec, _, _ = segment(0)
    store.register(rec)
    with pytest.raises(CorruptSegment):
        store.fetch(rec.seg_id, 0, CHUNKS)
    assert store.stats.corrupt_segments == 1 and lost == [rec.seg_id]
    store.close()


def test_sealed_units_are_sealed_under_distinct_nonces(tmp_path):
    """Two writes of the same KV give different ciphertext (a fresh salt per segment)."""
    a, rec, _, _ = written(tmp_path / "a", cipher())
    b, _, _, _ = written(tmp_path / "b", cipher())
    layout = _layout(a, rec.seg_id)
    x, y = a.path(rec.seg_id).read_bytes(), b.path(rec.seg_id).read_bytes()
    k = layout.kv_offset
    assert not np.array_equal(np.frombuffer(x[k : k + 64], np.uint8), np.frombuffer(y[k : k + 64], np.uint8))


@pytest.mark.parametrize(("data", "mode", "says"), [(b"short", 0o600, "holds 5 bytes"), (b"x" * 32, 0o644, "chmod")])
def test_the_launcher_stops_on_a_bad_key_file(tmp_path, capsys, data, mode, says):
    from sgl_loopkv.server.launch import build_sglang_argv

    with pytest.raises(SystemExit) as e:
        build_sglang_argv(["--loopkv-lifecycle-disk-key-file", str(key_file(tmp_path, data, mode))])
    assert e.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_sglang_argv(["--loopkv-lifecycle-disk-key-file", str(tmp_path / "missing")])
    assert "cannot read the key file" in capsys.readouterr().err


def test_a_sealed_file_copied_over_another_name_is_refused(tmp_path):
    store, rec, _, _ = written(tmp_path, cipher(), seed=0)
    other, _, _ = segment(1)
    other.seg_id = "s1"
    store.write(other, *segment(1)[1:])
    store.path("s1").write_bytes(store.path(rec.seg_id).read_bytes())  # intact under the key, wrong history
    with pytest.raises(CorruptSegment, match="names another segment"):
        store.read("s1", 0, CHUNKS)
