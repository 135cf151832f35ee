"""Disk-tier faults without a server (issue 16, point 5): a filesystem that fills up under the store,
an index that is garbage or names missing files, and the per-model directory key that keeps one
model's stored KV from another (weights replaced in place included)."""

from __future__ import annotations

import errno
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from sgl_loopkv.cache import disk as disk_mod
from sgl_loopkv.cache import disk_writer as writer_mod
from sgl_loopkv.cache.backend import model_fingerprint
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.segment_record import SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES

GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)
CHUNKS = 4


def segment(seed: int):
    g = torch.Generator().manual_seed(seed)
    t = CHUNKS * GEO.chunk_tokens
    kv = torch.randn(GEO.num_layers, 2, t, GEO.num_kv_heads, GEO.head_dim, generator=g)
    return SegmentRecord(f"s{seed}", None, 0, CHUNKS, 0, token_ids=list(range(t))), kv, key_summaries(kv[:, 0], 16)


def _used(root) -> int:
    return sum(f.stat().st_size for f in root.iterdir() if f.is_file())


class _FullDisk:
    """``open`` for the disk module that writes the bytes for real until ``root`` holds ``capacity``
    bytes, then fails the way a full filesystem does (ENOSPC) with the partial write left behind."""

    def __init__(self, root, capacity: int):
        self.root, self.capacity, self.refused = root, capacity, 0

    def __call__(self, file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)  # noqa: SIM115 (the caller's ``with`` closes it)
        return _LimitedFile(f, self) if "w" in mode else f

    def usage(self, path):
        """``shutil.disk_usage`` of this filesystem."""
        used = _used(self.root)
        return SimpleNamespace(total=self.capacity, used=used, free=max(self.capacity - used, 0))


class _LimitedFile:
    def __init__(self, f, fs: _FullDisk):
        self.f, self.fs = f, fs

    def write(self, b) -> int:
        room = self.fs.capacity - _used(self.fs.root)
        if len(b) > room:
            self.f.write(bytes(b)[: max(room, 0)])
            self.f.flush()
            self.fs.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def _capacity_for(tmp_path, n: int) -> int:
    """Bytes that hold ``n`` segments, not ``n + 1``."""
    probe = DiskSegmentStore(tmp_path / "probe", 1 << 30, GEO)
    for i in range(n):
        rec, kv, summ = segment(900 + i)
        probe.write(rec, kv, summ)
    return _used(probe.root) + rec.file_bytes // 2


@pytest.mark.parametrize("host", ["arena", "none"])
def test_a_full_disk_keeps_the_store_working_and_says_so(tmp_path, monkeypatch, caplog, host):
    """Another process fills the filesystem under a quota it could not foresee: the store keeps
    serving, stores less (the tier holds to what fits; new segments replace the least valuable),
    counts the refused write and logs it; nothing half-written or unindexed is left; what was stored
    still reads back bit-identical."""
    root = tmp_path / "disk"
    fs = _FullDisk(root, _capacity_for(tmp_path, 3))
    monkeypatch.setattr(disk_mod, "open", fs, raising=False)  # module global shadows the builtin
    monkeypatch.setattr(writer_mod, "disk_usage", fs.usage)
    lost = []
    store = TieredKVStore(
        GEO,
        VALUE_POLICIES.create("lru"),
        host_quota_bytes=(1 << 30) if host == "arena" else 0,  # 0: every write is synchronous, disk only
        disk_dir=root,
        disk_quota_bytes=1 << 30,
        on_lost=lost.append,
    )
    segs = {}
    with caplog.at_level(logging.WARNING, logger="sgl_loopkv.cache.disk_writer"):
        for i in range(8):
            rec, kv, summ = segment(i)
            segs[rec.seg_id] = kv
            stored = store.put(rec, kv, summ)
            store.flush()
            assert stored or host == "none", "with a host arena every put is kept"
            if i == 3:  # the first write that does not fit
                assert store.stats.disk_write_errors == store.stats.disk_full_writes == 1 and fs.refused == 1
                assert store.disk.quota_bytes == fs.capacity - _used(root) + store.disk.used_bytes
                assert stored == (host == "arena")  # kept in the arena; with none, nowhere
    store.sync()
    assert store.stats.disk_write_errors == store.stats.disk_full_writes == 1  # later stores fit the lowered quota
    assert "disk full writing segment s3" in caplog.text and "quota lowered" in caplog.text
    assert not list(root.glob("*.tmp"))
    on_disk = sorted(sid for sid, s in store.segments.items() if s.on_disk)
    assert sorted(f.stem.removeprefix("seg_") for f in root.glob("seg_*.kv")) == on_disk
    assert "s7" in on_disk and len(on_disk) < 8  # the newest is stored, older ones made room
    for sid in on_disk:
        assert torch.equal(store.disk.read(sid, 0, CHUNKS), segs[sid])
    if host == "arena":  # nothing lost: every segment is in the arena or on disk
        assert not lost and all(store.tier_of(sid) is not None for sid in segs)
    else:  # the refused one was never stored; the ones that made room are reported lost
        assert "s3" not in store.segments and lost and all(store.tier_of(sid) is None for sid in lost)
    store.close()


def test_a_failed_publish_leaves_nothing_behind(tmp_path, monkeypatch):
    """The name or a chunk link refused (a full directory, an I/O error): no temp file stays, and a
    later write of the same segment works."""
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(1)
    rec.chunk_hashes = [f"{j:032x}" for j in range(CHUNKS)]

    def refused(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", refused)
    with pytest.raises(OSError):
        store.write(rec, kv, summ)
    monkeypatch.undo()
    assert not list(tmp_path.glob("*.tmp")) and not store.path("s1").exists()
    assert not list((tmp_path / "chunks").iterdir())
    store.write(rec, kv, summ)
    assert torch.equal(store.read("s1", 0, CHUNKS), kv)
    assert len(list((tmp_path / "chunks").iterdir())) == CHUNKS


@pytest.mark.parametrize("index", [b"", b"{not json", b'{"version": 2}', b"[1, 2]", b"\x00\xff" * 64])
def test_a_garbage_legacy_index_is_dropped_and_nothing_else(tmp_path, index):
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    store.write(*segment(1))
    (tmp_path / "index.json").write_bytes(index)
    again = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    assert not (tmp_path / "index.json").exists() and again.read_header("s1")["seg_id"] == "s1"


def test_the_directory_key_changes_with_weights_config_and_geometry(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 3}')
    (model / "model.safetensors").write_bytes(b"a" * 64)
    key = model_fingerprint(str(model), GEO)
    assert model_fingerprint(str(model), GEO) == key  # stable across restarts
    assert model_fingerprint(str(model), KVGeometry(3, 2, 8, torch.bfloat16, 16)) != key  # --dtype
    assert model_fingerprint(str(model), KVGeometry(3, 2, 8, torch.float32, 32)) != key  # --page-size
    (model / "model.safetensors").write_bytes(b"b" * 64)  # weights replaced in place, same size
    os.utime(model / "model.safetensors", ns=(1, 1))
    replaced = model_fingerprint(str(model), GEO)
    assert replaced != key
    (model / "config.json").write_text('{"num_hidden_layers": 4}')
    reconfigured = model_fingerprint(str(model), GEO)
    assert reconfigured != replaced
    (model / "tokenizer.json").write_text("{}")  # not weights: the key stays
    assert model_fingerprint(str(model), GEO) == reconfigured


def test_the_directory_key_of_a_gguf_file_changes_when_the_file_is_replaced(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"a" * 60)
    key = model_fingerprint(str(model), GEO)
    assert model_fingerprint(str(model), GEO) == key
    model.write_bytes(b"GGUF" + b"b" * 60)  # re-quantized in place, same size
    os.utime(model, ns=(1, 1))
    assert model_fingerprint(str(model), GEO) != key
