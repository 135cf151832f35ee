"""The tiered store's parts, engine-free: on-disk layout, crash-safe checksummed segment files,
quotas and value-ordered eviction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, SegmentFileLayout, baseline_block_read_bytes, key_summaries
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES

GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)


def segment(n_chunks: int, seed: int, geo: KVGeometry = GEO, parent=None, start=0):
    g = torch.Generator().manual_seed(seed)
    t = n_chunks * geo.chunk_tokens
    kv = torch.randn(geo.num_layers, 2, t, geo.num_kv_heads, geo.head_dim, generator=g).to(geo.dtype)
    rec = SegmentRecord(f"s{seed}", parent, start, n_chunks, 0, token_ids=list(range(start, start + t)))
    return rec, kv, key_summaries(kv[:, 0], geo.chunk_tokens)


def test_layout_extents_are_aligned_and_layer_major_with_group_1():
    lay = SegmentFileLayout(GEO, n_chunks=5, kv_offset=4096)
    assert GEO.extent_bytes % 512 == 0 and lay.kv_offset % 4096 == 0
    smollm2 = KVGeometry(30, 3, 64, torch.float32, 16)  # fp32 / bf16 chunks are whole 4 KiB pages
    assert smollm2.extent_bytes == 6 * 4096 and KVGeometry(30, 3, 64, torch.bfloat16, 16).extent_bytes == 3 * 4096
    assert lay.extent_offset(1, 0) == lay.extent_offset(0, 4) + GEO.extent_bytes  # layer-major, contiguous
    eb = GEO.extent_bytes
    assert [(b.offset, b.length(eb)) for b in lay.blocks(range(2, 3), [0, 1, 2, 4])] == [
        (lay.extent_offset(2, 0), 3 * eb),
        (lay.extent_offset(2, 4), eb),
    ]


def test_grouped_layout_reads_a_chunk_run_for_a_whole_group_at_once():
    geo = KVGeometry(num_layers=5, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)
    lay, eb = SegmentFileLayout(geo, n_chunks=6, kv_offset=4096, group=2), geo.extent_bytes
    # groups [0, 2), [2, 4), [4, 5): a chunk's rows of one group adjacent, then the next chunk
    assert lay.extent_offset(1, 0) == lay.extent_offset(0, 0) + eb
    assert lay.extent_offset(0, 1) == lay.extent_offset(1, 0) + eb
    assert lay.extent_offset(2, 0) == lay.extent_offset(1, 5) + eb
    assert (
        lay.extent_offset(4, 0) == lay.extent_offset(3, 5) + eb and lay.extent_offset(4, 5) + eb == lay.summary_offset
    )
    whole = lay.blocks(range(2, 4), [0, 1, 2, 5])  # a whole group: adjacent chunks coalesce
    assert [(b.offset, b.length(eb)) for b in whole] == [
        (lay.extent_offset(2, 0), 6 * eb),
        (lay.extent_offset(2, 5), 2 * eb),
    ]
    part = lay.blocks(range(1, 3), [0, 1])  # half of two groups: a read per chunk and group
    assert [(b.row0, b.row1, b.chunk0, b.n_chunks) for b in part] == [
        (1, 2, 0, 1),
        (1, 2, 1, 1),
        (2, 3, 0, 1),
        (2, 3, 1, 1),
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 7),  # layers
    st.integers(1, 8),  # group
    st.integers(1, 9),  # chunks
    st.data(),
)
def test_layout_blocks_cover_each_asked_extent_once_and_nothing_else(layers, group, n_chunks, data):
    geo = KVGeometry(layers, 1, 8, torch.float32, 16)
    lay, eb = SegmentFileLayout(geo, n_chunks, 4096, group=group), geo.extent_bytes
    r0 = data.draw(st.integers(0, layers - 1))
    rows = range(r0, data.draw(st.integers(r0 + 1, layers)))
    chunks = sorted(data.draw(st.sets(st.integers(0, n_chunks - 1), min_size=1)))
    seen = []
    for b in lay.blocks(rows, chunks):
        offs = [b.offset + i * eb for i in range(b.length(eb) // eb)]
        assert offs == [
            lay.extent_offset(r, j) for j in range(b.chunk0, b.chunk0 + b.n_chunks) for r in range(b.row0, b.row1)
        ]
        seen += [(r, j) for j in range(b.chunk0, b.chunk0 + b.n_chunks) for r in range(b.row0, b.row1)]
    assert sorted(seen) == sorted((r, j) for r in rows for j in chunks)
    every = sorted(lay.extent_offset(r, j) for r in range(layers) for j in range(n_chunks))
    assert every == [4096 + i * eb for i in range(layers * n_chunks)]  # a permutation of the extents


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_every_grouping_reads_back_bit_identical_and_each_bad_extent_is_its_own(tmp_path, group):
    geo = KVGeometry(5, 2, 8, torch.float32, 16)
    store = DiskSegmentStore(tmp_path, 1 << 30, geo, layer_group=group)
    rec, kv, summ = segment(6, 3, geo)
    store.write(rec, kv, summ)
    assert store.read_header(rec.seg_id)["layer_group"] == min(group, 5)
    assert torch.equal(store.read(rec.seg_id, 0, 6), kv)
    first = [0, 2, 6, 1, 3]  # the restorer's recompute split: layer l from chunk first[l] (before it: zero)
    got = store.read(rec.seg_id, 1, 5, first)
    for layer, f in enumerate(first):
        lo = max(f, 1)
        assert torch.equal(got[layer, :, (lo - 1) * 16 :], kv[layer, :, lo * 16 : 5 * 16])
        assert not got[layer, :, : max(lo - 1, 0) * 16].any()
    fd, header = store.open_for_chunks(rec.seg_id)
    try:
        chunks = [0, 2, 3, 5]
        tok = torch.tensor([j * 16 + t for j in chunks for t in range(16)])
        for rows in (range(0, 5), range(1, 3), range(4, 5)):
            rkv, bad = store.read_chunks(fd, rec.seg_id, header, rows, chunks)
            assert rkv.shape == (len(rows), 2, len(chunks), 16, 2, 8)  # per chunk: a view of the read buffer
            rkv = rkv.flatten(2, 3)
            assert torch.equal(rkv, kv[rows.start : rows.stop][:, :, tok]) and bad == [[] for _ in rows]
        off = store.codec.layout(header).extent_offset(3, 2)
        with open(store.path(rec.seg_id), "r+b") as f:  # one bit of (layer 3, chunk 2)
            f.seek(off + 7)
            b = f.read(1)
            f.seek(off + 7)
            f.write(bytes([b[0] ^ 1]))
        rkv, bad = store.read_chunks(fd, rec.seg_id, header, range(2, 5), chunks)
        rkv = rkv.flatten(2, 3)
        assert bad == [[], [2], []]
        assert not rkv[1, :, 16:32].any() and torch.equal(rkv[1, :, 32:], kv[3][:, tok[32:]])
        assert torch.equal(rkv[0], kv[2][:, tok]) and torch.equal(rkv[2], kv[4][:, tok])
    finally:
        os.close(fd)
    with pytest.raises(CorruptSegment):
        store.read(rec.seg_id, 0, 6)


def test_key_summaries_are_per_chunk_per_head_min_max():
    k = torch.randn(2, 32, 3, 4)
    s = key_summaries(k, 16)
    assert s.shape == (2, 2, 3, 2, 4)
    torch.testing.assert_close(s[1, 1, 2, 0], k[1, 16:, 2].amin(0))
    torch.testing.assert_close(s[0, 0, 1, 1], k[0, :16, 1].amax(0))


def test_baseline_block_read_amplification():
    # 16 tokens inside one 64-token block: the block layout reads 64 -> 4x
    assert baseline_block_read_bytes([(64, 80)], GEO) == 4 * 16 * GEO.token_bytes_per_layer * GEO.num_layers
    assert baseline_block_read_bytes([(0, 128)], GEO) == 128 * GEO.token_bytes_per_layer * GEO.num_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_roundtrip_is_bit_identical(tmp_path, dtype):
    geo = KVGeometry(3, 2, 8, dtype, 16)
    store = DiskSegmentStore(tmp_path, 1 << 30, geo)
    rec, kv, summ = segment(4, 1, geo)
    store.write(rec, kv, summ)
    assert torch.equal(store.read(rec.seg_id, 0, 4), kv)
    assert torch.equal(store.read(rec.seg_id, 1, 3), kv[:, :, 16:48])
    assert torch.equal(store.read_summaries(rec.seg_id), summ.to(geo.summary_dtype))  # fp16 next to bf16 KV
    # another worker (a new store on the directory) reads it by name
    again = DiskSegmentStore(tmp_path, 1 << 30, geo)
    assert again.read_header(rec.seg_id)["token_ids"] == rec.token_ids
    assert torch.equal(again.read(rec.seg_id, 0, 4), kv)


def _corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF  # inside the KV extents
        path.write_bytes(bytes(data))
    elif how == "flip_header":
        data[40] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) * 2 // 3]))
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize("how", ["flip", "flip_header", "truncate", "delete"])
def test_every_disk_fault_is_detected(tmp_path, how):
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(6, 2)
    store.write(rec, kv, summ)
    _corrupt(store.path(rec.seg_id), how)
    with pytest.raises(CorruptSegment):
        store.read(rec.seg_id, 0, 6)


def test_interrupted_writes_leave_no_trace(tmp_path):
    """A writer killed mid-write leaves a temp file: the next worker to start removes it if its
    writer is gone (same host, dead pid), never one a live worker is still writing."""
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(2, 3)
    store.write(rec, kv, summ)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = store.dir.host
    (tmp_path / f"{host}.{int(dead.stdout)}.abcd1234.4096.tmp").write_bytes(b"half a write")  # its writer died
    live = tmp_path / f"{host}.{os.getpid()}.abcd1234.4096.tmp"
    live.write_bytes(b"being written")
    again = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == [live.name]
    assert torch.equal(again.read(rec.seg_id, 0, 2), kv)


def test_a_segment_of_another_geometry_or_format_is_not_trusted(tmp_path):
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(1, 4)
    store.write(rec, kv, summ)
    other = DiskSegmentStore(tmp_path, 1 << 30, KVGeometry(3, 2, 16, torch.float32, 16))
    with pytest.raises(CorruptSegment, match="another format or KV geometry"):
        other.read(rec.seg_id, 0, 1)


def test_a_format_2_directory_is_dropped_with_a_warning(tmp_path, caplog):
    """The single-server layout (index.json + seg_<uuid>.kv) is not shareable: its files go, said once."""
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ = segment(1, 5)
    store.write(rec, kv, summ)
    (tmp_path / "seg_0123abcd.kv").write_bytes(b"a format-2 segment")
    (tmp_path / "index.json").write_text(json.dumps({"version": 2, "segments": {"0123abcd": {}}}))
    with caplog.at_level("WARNING"):
        again = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    assert "format-2 disk tier" in caplog.text and "1 segments are dropped" in caplog.text
    assert not (tmp_path / "index.json").exists() and not (tmp_path / "seg_0123abcd.kv").exists()
    assert torch.equal(again.read(rec.seg_id, 0, 1), kv)  # this format's files are untouched


def test_names_never_leave_the_directory(tmp_path):
    """Segment ids and chunk hashes become file names: a tampered header or a hostile id must not
    make the store read or delete anything outside its directory (ids are minted by the cache)."""
    root = tmp_path / "disk"
    store = DiskSegmentStore(root, 1 << 30, GEO)
    rec, kv, summ = segment(1, 6)
    rec.chunk_hashes = ["0" * 32]
    store.write(rec, kv, summ)
    victim = tmp_path / "seg_x.kv"  # what "../x" would name
    victim.write_bytes(b"not the cache's")
    for sid in ("../x", "a/b", ".."):
        with pytest.raises(ValueError, match="not a segment id"):
            store.delete(sid)
    with pytest.raises(ValueError, match="not a chunk hash"):
        store.find(["../../x"], 0)
    assert victim.read_bytes() == b"not the cache's"
    # private to the server's user whatever the umask: no group or world access
    assert all(p.stat().st_mode & 0o077 == 0 for p in [root, *root.iterdir(), *(root / "chunks").iterdir()])


def _tier_bytes(store: TieredKVStore) -> tuple[int, int]:
    host = sum(s.host_kv.numel() * 4 + s.host_summaries.numel() * 4 for s in store.segments.values() if s.in_host)
    disk = sum(p.stat().st_size for p in store.disk.root.glob("seg_*.kv"))
    return host, disk


@pytest.mark.parametrize("policy", ["attention", "lru"])
def test_quotas_hold_and_losses_are_reported(tmp_path, policy):
    one = GEO.segment_host_bytes(4)
    lost = []
    store = TieredKVStore(
        GEO,
        VALUE_POLICIES.create(policy),
        host_quota_bytes=3 * one,
        disk_dir=tmp_path,
        disk_quota_bytes=8 * DiskSegmentStore(tmp_path.with_name(tmp_path.name + "-est"), 0, GEO).file_bytes(4, 64),
        on_lost=lost.append,
    )
    for i in range(30):
        rec, kv, summ = segment(4, 100 + i)
        assert store.put(rec, kv, summ)
        store.flush()
        host, disk = _tier_bytes(store)
        assert host <= store.host_quota and host == store.stats.host_bytes
        assert disk <= store.disk.quota_bytes
    store.sync()
    assert len(lost) == 30 - len(store.segments) > 0
    assert all(store.tier_of(s) is None for s in lost)


def test_fetch_from_disk_promotes_and_corruption_forgets(tmp_path):
    one = GEO.segment_host_bytes(4)
    lost = []
    store = TieredKVStore(
        GEO,
        VALUE_POLICIES.create("lru"),
        host_quota_bytes=one,
        disk_dir=tmp_path,
        disk_quota_bytes=1 << 30,
        on_lost=lost.append,
    )
    segs = [segment(4, 200 + i) for i in range(3)]
    for rec, kv, summ in segs:
        store.put(rec, kv, summ)
    store.flush()
    first = segs[0][0].seg_id
    assert store.tier_of(first) == "disk"
    kv, tier = store.fetch(first, 1, 3)
    assert tier == "disk" and torch.equal(kv, segs[0][1][:, :, 16:48])
    assert store.tier_of(first) == "host" and store.stats.disk_bytes_read >= store.stats.disk_bytes_used > 0
    second = segs[1][0].seg_id
    _corrupt(store.disk.path(second), "flip")
    with pytest.raises(CorruptSegment):
        store.fetch(second, 0, 4)
    assert lost == [second] and store.stats.corrupt_segments == 1 and not store.disk.path(second).exists()


def test_a_read_ahead_reads_on_its_thread_once_and_fails_like_an_inline_read(tmp_path):
    """--loopkv-tier-disk-read background (cache/prefetch.py): the whole segment is read and verified on
    the prefetch thread; fetch then takes that read (no second one) and promotes it as before; a
    damaged file raises in fetch and is forgotten exactly as an inline read's."""
    one = GEO.segment_host_bytes(4)
    lost = []
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), one, tmp_path, 1 << 30, on_lost=lost.append)
    segs = [segment(4, 400 + i) for i in range(3)]
    for rec, kv, summ in segs:
        store.put(rec, kv, summ)
    store.flush()
    first, second = segs[0][0].seg_id, segs[1][0].seg_id
    assert store.tier_of(first) == "disk"
    threads, read = [], store.disk.read
    store.disk.read = lambda *a: (threads.append(threading.current_thread().name), read(*a))[1]
    store.read_ahead(first)
    while not store.read_ahead_done(first):
        time.sleep(0.005)
    assert not store.read_ahead(first)  # done: not read again
    kv, tier = store.fetch(first, 1, 3, skip_chunks=[1, 0, 0])  # the whole read serves a partial ask too
    assert tier == "disk" and torch.equal(kv, segs[0][1][:, :, 16:48])
    assert threads == ["loopkv-disk-prefetch_0"] and store.tier_of(first) == "host"  # one read, promoted
    assert store.stats.disk_bytes_read >= store.stats.disk_bytes_used > 0
    _corrupt(store.disk.path(second), "flip")
    store.read_ahead(second)
    with pytest.raises(CorruptSegment):
        store.fetch(second, 0, 4)  # waits for the read in flight, then raises what it raised
    assert lost == [second] and store.stats.corrupt_segments == 1 and not store.disk.path(second).exists()
    assert len(threads) == 2 and set(threads) == {"loopkv-disk-prefetch_0"}
    inline = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), one, tmp_path / "i", 1 << 30, read_ahead=False)
    assert inline.prefetch is None and not inline.read_ahead("anything")
    store.close()
    inline.close()


def test_reads_ahead_nobody_takes_are_let_go():
    from sgl_loopkv.cache.prefetch import DiskPrefetch, PrefetchedRead

    def read(i: int, nbytes: int = 1):
        return lambda: PrefetchedRead(torch.full((nbytes,), i, dtype=torch.uint8), nbytes, 0.0)

    pf = DiskPrefetch(max_done=2, ttl_s=60.0)
    for i in range(4):
        pf.start(f"s{i}", read(i))
    while not pf.done("s3"):
        time.sleep(0.005)
    pf.start("s4", read(4))  # each start lets the oldest untaken reads go
    assert pf.take("s0") is None and pf.take("s1") is None and pf.expired >= 2
    assert pf.take("s3").kv[0] == 3 and pf.take("s3") is None  # taken once
    pf.discard("s4")
    assert pf.take("s4") is None
    big = DiskPrefetch(max_done=8, ttl_s=60.0, max_done_bytes=250)  # and by the RAM they hold
    for i in range(3):
        big.start(f"b{i}", read(i, 100))
        while not big.done(f"b{i}"):
            time.sleep(0.005)
    big.start("b3", read(3, 1))  # 300 B held when it starts: the oldest goes
    assert big.take("b0") is None and big.take("b1").kv[0] == 1 and big.expired == 1


def test_disk_eviction_is_lru_over_every_worker_and_cuts_histories_from_their_end(tmp_path):
    """The shared tier evicts by file mtime (bumped on every use, by any worker), and within one
    second the deepest segment first: a history loses its end before its root."""
    size = DiskSegmentStore(tmp_path.with_name(tmp_path.name + "-est"), 0, GEO).file_bytes(4, 64)
    a, b = DiskSegmentStore(tmp_path, 3 * size, GEO), DiskSegmentStore(tmp_path, 3 * size, GEO)  # two workers
    root, child = segment(4, 300), segment(4, 301, start=64)
    root[0].seg_id, child[0].seg_id = "000000-root", "000004-child"
    a.write(*root)
    b.write(*child)
    other = segment(4, 302)
    other[0].seg_id = "000000-other"
    a.write(*other)
    stamp = 1_700_000_000
    for seg, t in (("000000-root", stamp), ("000004-child", stamp), ("000000-other", stamp + 5)):
        os.utime(a.path(seg), (t, t))
    new = segment(4, 303)
    new[0].seg_id = "000000-new"
    assert b.write(*new) == ["000004-child"]  # oldest second; the deeper of the two
    assert a.write(*segment(4, 304)) == ["000000-root"]


def test_attention_value_prefers_important_and_recent_segments():
    pol = VALUE_POLICIES.create("attention")
    pol.on_access("cold", 4)
    pol.on_access("hot", 4)
    for _ in range(5):
        pol.on_access("hot", 4, importance=torch.tensor([2.8, 0.4, 0.4, 0.4]))
    assert pol.value("hot") > pol.value("cold")
    decaying = VALUE_POLICIES.create("attention", half_life=4.0)
    for _ in range(3):
        decaying.on_access("old", 2)
    v0 = decaying.value("old")
    for i in range(40):
        decaying.on_access(f"new{i}", 2)
    assert decaying.value("old") < v0 / 100  # old popularity fades
    json.dumps(decaying.value("old"))


def test_chunk_attention_mass_sums_softmax_per_chunk():
    from sgl_loopkv.cache.importance import chunk_attention_mass

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(3, 4, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    mass = chunk_attention_mass(q, k, 0.5, 16)
    probs = torch.softmax(torch.einsum("nhd,phd->hnp", q, k.repeat_interleave(2, dim=1)) * 0.5, dim=-1)
    assert mass.shape == (3,)
    torch.testing.assert_close(
        mass, torch.stack([probs[..., :16].sum(), probs[..., 16:32].sum(), probs[..., 32:].sum()])
    )
    assert abs(float(mass.sum()) - 3 * 4) < 1e-4  # every row of every head sums to 1


def test_attention_value_ranks_segments_by_the_mass_they_received():
    pol = VALUE_POLICIES.create("attention")
    pol.on_access("relied_on", 2, importance=torch.tensor([1.8, 1.6]))
    pol.on_access("ignored", 2, importance=torch.tensor([0.3, 0.3]))
    assert pol.value("relied_on") > pol.value("ignored")


def test_queued_disk_writes_are_flushed_when_the_process_exits(tmp_path):
    """A store put just before a normal exit is on disk after it (the writer thread is a daemon:
    without the exit flush the queued write would be dropped)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from sgl_loopkv.cache.segment_record import SegmentRecord
        from sgl_loopkv.cache.layout import KVGeometry
        from sgl_loopkv.cache.store import TieredKVStore
        from sgl_loopkv.cache.value import LRUValuePolicy
        g = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)
        store = TieredKVStore(g, LRUValuePolicy(), 1 << 30, Path({str(tmp_path)!r}), 1 << 30)
        for i in range(8):
            store.put(SegmentRecord(f"seg{{i}}", None, 0, 64, 0, token_ids=list(range(1024))), torch.randn(3, 2, 1024, 2, 8))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("seg_*.kv")) == [f"seg_seg{i}.kv" for i in range(8)]


@pytest.mark.parametrize("group", [1, 2, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_file_order_copy_equals_the_extent_by_extent_layout(group, dtype):
    """The one-copy file order of float rows is byte for byte the general path's (transpose each
    row's chunks into extents, then regroup: per group of rows, per chunk, its rows)."""
    import numpy as np

    from sgl_loopkv.cache.segment_encode import _file_order, _to_bytes

    R, m, c, H, D = 5, 7, 16, 2, 8
    rows = torch.randn(R, 2, m * c, H, D).to(dtype)
    ext = _to_bytes(rows.reshape(R, 2, m, c, H, D).transpose(1, 2).contiguous()).reshape(R, m, -1)
    want = np.concatenate(
        [ext[g0 : g0 + group].transpose(1, 0, 2).reshape(-1, ext.shape[2]) for g0 in range(0, R, group)]
    )
    assert np.array_equal(_file_order(rows, m, c, group), want)


def test_checksums_are_zlibs_crc32_from_zlib_ng_when_installed():
    """Files written with either implementation verify with the other: the same CRC-32 values (zlib's
    polynomial) over bytes and memoryviews of any length; zlib-ng's is the one used when installed."""
    import importlib.util
    import zlib

    from sgl_loopkv.cache.segment_check import crc32

    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 15, 16, 4095, 24576, 1 << 20):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
        assert crc32(data) == zlib.crc32(data) and crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])
    if importlib.util.find_spec("zlib_ng") is not None:
        assert crc32.__module__ == "zlib_ng.zlib_ng"


def test_writes_another_worker_may_wait_for_run_at_normal_priority(tmp_path):
    """Alone on its directory a store writes from its background-priority thread; while another
    process holds the directory (its lookups wait for announced writes, 2 s at most), from the
    normal-priority one. Presence is the kernel's view of POSIX locks: a worker killed with -9
    drops out at once."""
    import signal
    import subprocess
    import sys
    import threading

    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), GEO.segment_host_bytes(4) * 4, tmp_path, 1 << 30)
    root = store.disk.root
    threads = []
    write = store.writers.write
    store.writers.write = lambda seg_id: (threads.append(threading.current_thread().name), write(seg_id))
    assert not store.disk.presence.others()
    store.put(*segment(4, 300))
    store.flush()
    code = f"from pathlib import Path; from sgl_loopkv.cache.disk_dir import Presence; p = Presence(Path({str(root)!r})); print('in', flush=True); import time; time.sleep(60)"
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "in"
        assert store.disk.presence.others()
        store.put(*segment(4, 301))
        store.flush()
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert not store.disk.presence.others()
    assert threads == ["loopkv-disk-writer", "loopkv-disk-writer-shared"]
    store.close()


def test_request_states_are_one_bounded_map_oldest_touched_forgotten_first():
    from sgl_loopkv.cache.requests import RequestStates

    states = RequestStates(capacity=3)
    for rid in "abc":
        states.of(rid).loads["host"] += 1
    states.of("a").probed = True  # touched: "b" is now the oldest
    assert states.get("zz") is None and len(states) == 3  # a read creates nothing
    states.of("d")
    assert states.get("b") is None and states.get("a").probed and states.get("a").loads["host"] == 1
    assert len(states) == 3
