"""The disk tier shared by several workers (issue 17), without servers: a history stored by one
worker's tree is found and loaded by another's whatever the segment boundaries; two workers storing
the same history leave one valid segment; eviction by several processes under one quota never
exceeds it and never takes a segment away from a reader; a segment evicted under a worker's tree
is recomputed, not served."""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_loopkv.cache.address import chunk_chain, namespace, segment_id
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.disk_announce import Announced
from sgl_loopkv.cache.disk_dir import SharedDirectory
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.segment_record import FORMAT_VERSION, SegmentGone, SegmentRecord
from tests.unit.test_radix_tree import CHUNK, LAYERS, SLOTS, add_turn, make_cache

GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)


def kv_at(cache, node) -> torch.Tensor:
    """[L, 2, T, H, D]: the device KV of the path from the root to ``node``."""
    slots = cache.path_device_indices(node).to(torch.int64)
    pool = cache.kv_pool
    return torch.stack(
        [torch.stack([pool.k_buffer[layer][slots], pool.v_buffer[layer][slots]]) for layer in range(LAYERS)]
    )


def resume(cache, tokens: list[int]):
    """A request for ``tokens`` + one new chunk: what it gets back, and the KV it got."""
    match = cache.match_prefix(
        MatchPrefixParams(key=RadixKey(tokens + [7] * CHUNK, None), req=SimpleNamespace(rid="r"))
    )
    cache.loader.wait_all()
    return match, kv_at(cache, match.last_device_node)


def test_another_worker_finds_a_history_whatever_its_segment_boundaries(tmp_path):
    """A stores a history in two turns (segments [0, 2) and [2, 4) chunks); B, which never saw the
    first turn, stores the longer history as one segment [0, 6). C, a fresh worker, resumes all six
    chunks: A's two segments and the tail of B's (chunk by chunk lookup, one open per segment)."""
    h1, h2, h3 = list(range(100, 132)), list(range(200, 232)), list(range(300, 332))
    a, a_alloc = make_cache(tmp_path, host_bytes=1 << 20)
    b, b_alloc = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(a, a_alloc, h1)
    a_node = add_turn(a, a_alloc, h1 + h2)
    a_kv = kv_at(a, a_node)
    b.kv_pool.k_buffer = [k + 1 for k in b.kv_pool.k_buffer]  # B's KV differs from A's: the source shows
    b.kv_pool.v_buffer = [v + 1 for v in b.kv_pool.v_buffer]
    b.store.disk.probe = lambda chain, first: None  # B does not look: it computes the whole history itself
    b_node = add_turn(b, b_alloc, h1 + h2 + h3)
    b_kv = kv_at(b, b_node)
    assert len(list(tmp_path.glob("seg_*.kv"))) == 3

    c, _ = make_cache(tmp_path, host_bytes=1 << 20)
    match, got = resume(c, h1 + h2 + h3)
    assert match.device_prefix_len == 96
    assert torch.equal(got[:, :, :64], a_kv)  # chunks 0-3: A's segments (linked first)
    assert torch.equal(got[:, :, 64:], b_kv[:, :, 64:])  # chunks 4-5: the tail of B's [0, 6)
    assert c.store.stats.hit_tokens["disk"] == 96


def test_a_segment_evicted_by_another_worker_is_recomputed_not_served(tmp_path):
    h = list(range(100, 164))
    a, a_alloc = make_cache(tmp_path, host_bytes=0)  # disk only
    b, _ = make_cache(tmp_path, host_bytes=0)
    add_turn(a, a_alloc, h[:32])
    add_turn(a, a_alloc, h)
    match, _ = resume(b, h)  # B finds both segments and loads them
    assert match.device_prefix_len == 64
    b.evict(EvictParams(num_tokens=SLOTS))  # B keeps them only as stored nodes
    deep = sorted(tmp_path.glob("seg_*.kv"))[-1]  # the second turn's segment (its start is in the name)
    a.store.disk.delete(deep.stem.removeprefix("seg_"))  # evicted by another worker
    match, _ = resume(b, h)
    assert match.device_prefix_len == 32  # the rest is recomputed
    assert b.store.stats.gone_segments == 1 and b.store.stats.corrupt_segments == 0


def _segment(seed: int, n_chunks: int = 2):
    tokens = [seed * 1000 + i for i in range(n_chunks * GEO.chunk_tokens)]
    chain = chunk_chain(tokens, GEO.chunk_tokens, namespace(FORMAT_VERSION, GEO.to_json(), None, None))
    kv = torch.randn(
        GEO.num_layers, 2, len(tokens), GEO.num_kv_heads, GEO.head_dim, generator=torch.Generator().manual_seed(seed)
    )
    rec = SegmentRecord(segment_id(0, chain[-1]), None, 0, n_chunks, 0, token_ids=tokens, chunk_hashes=chain)
    return rec, kv, key_summaries(kv[:, 0], GEO.chunk_tokens), chain


WORKER = """
import sys, time, torch
from pathlib import Path
from sgl_loopkv.cache.address import chunk_chain, namespace, segment_id
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.segment_record import FORMAT_VERSION, SegmentRecord
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_tokens=16)
{segment}
store = DiskSegmentStore(Path(sys.argv[1]), int(sys.argv[2]), GEO)
print("ready", flush=True)
go = Path(sys.argv[1]) / "go"
while not go.exists():  # every worker starts writing at the same moment
    time.sleep(0.001)
for seed in [int(s) for s in sys.argv[3].split(",")]:
    rec, kv, summ, _ = _segment(seed)
    store.write(rec, kv, summ)
print("done", flush=True)
"""


def _workers(root, quota: int, seed_lists: list[list[int]]) -> list[subprocess.Popen]:
    root.mkdir(exist_ok=True)
    code = textwrap.dedent(WORKER).format(segment=inspect.getsource(_segment))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(root), str(quota), ",".join(map(str, seeds))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seeds in seed_lists
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
    (root / "go").touch()
    return procs


def _finish(procs) -> None:
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "done" in out, err[-3000:]


def test_two_workers_storing_the_same_history_leave_one_valid_segment(tmp_path):
    procs = _workers(tmp_path, 1 << 30, [[1, 2, 3], [1, 2, 3]])  # the same three histories, at once
    _finish(procs)
    names = sorted(p.name for p in tmp_path.glob("seg_*.kv"))
    assert len(names) == 3 and not list(tmp_path.glob("*.tmp"))
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    for seed in (1, 2, 3):
        rec, kv, _, chain = _segment(seed)
        assert torch.equal(store.read(rec.seg_id, 0, 2), kv)
        found = store.find(chain, 1)
        assert found.record.seg_id == rec.seg_id and (found.lo, found.hi) == (1, 2)
    assert len(list((tmp_path / "chunks").iterdir())) == 6  # one link per chunk, whoever published first


def _bytes_held(root) -> int:
    """What the directory holds, each inode once (a segment and its chunk links are one file)."""
    seen = {}
    for d in (root, root / "chunks"):
        for e in os.scandir(d):
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            if e.is_file():
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_eviction_by_three_workers_never_exceeds_the_quota_nor_breaks_a_read(tmp_path):
    """Three writer processes, 20 segments each, under a quota of 6 segments; meanwhile this process
    samples the bytes held and reads whatever it finds: every read is bit-exact or finds the segment
    gone (never corrupt), and the bytes held never pass the quota."""
    probe = DiskSegmentStore(tmp_path / "probe", 1 << 30, GEO)
    rec, kv, summ, _ = _segment(0)
    probe.write(rec, kv, summ)
    quota = 6 * rec.file_bytes + rec.file_bytes // 2
    root = tmp_path / "shared"
    reader = DiskSegmentStore(root, quota, GEO)
    expected = {_segment(s)[0].seg_id: s for s in range(1, 61)}
    procs = _workers(root, quota, [list(range(1 + 20 * w, 21 + 20 * w)) for w in range(3)])
    peak, reads, gone, stop = 0, 0, 0, threading.Event()

    def watch():  # a snapshot needs the eviction lock (a scandir racing an eviction sees both files)
        nonlocal peak
        while not stop.is_set():
            with SharedDirectory(root).eviction_lock():
                peak = max(peak, _bytes_held(root))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        while any(p.poll() is None for p in procs):
            for f in list(root.glob("seg_*.kv")):
                sid = f.stem.removeprefix("seg_")
                try:
                    got = reader.read(sid, 0, 2)
                except SegmentGone:
                    gone += 1
                    continue
                assert torch.equal(got, _segment(expected[sid])[1])
                reads += 1
    finally:
        stop.set()
        watcher.join()
    _finish(procs)
    usage = SharedDirectory(root).scan()
    assert peak <= quota, (peak, quota)
    assert usage.total <= quota and usage.reserved == 0 and not list(root.glob("*.tmp"))
    assert reads > 0 and len(usage.published) >= 5  # the quota was used, not emptied
    for f in usage.published:  # what is left is intact and findable
        assert torch.equal(reader.read(f.seg_id, 0, 2), _segment(expected[f.seg_id])[1])
    links = list((root / "chunks").iterdir())
    assert len(links) == 2 * len(usage.published) and all(p.stat().st_nlink >= 2 for p in links)


def test_a_published_segment_keeps_no_temp_name_once_the_lock_is_released(tmp_path):
    """The temp name of a published segment goes under the eviction lock: a temp name left after it
    would keep the bytes of the segment alive while another worker evicts it and counts them freed
    (the three-worker test above once saw seven segments under a quota of six and a half)."""
    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    held, lock = [], store.dir.eviction_lock

    @contextlib.contextmanager
    def watched():
        with lock():
            yield
            held.append(sorted(p.stat().st_nlink for p in tmp_path.glob("*.tmp")))  # still under the lock

    store.dir.eviction_lock = watched
    rec, kv, summ, _ = _segment(3)
    store.write(rec, kv, summ)
    assert held == [[1], []]  # reserved while written (one name), gone when published


def test_a_lookup_waits_for_an_announced_write_and_not_otherwise(tmp_path):
    """The next turn may reach another worker before the first's segment is written: an announced
    segment is waited for (briefly), an unannounced miss returns at once, and a dead writer's
    announcement is removed by the next worker to start."""
    writer, reader = DiskSegmentStore(tmp_path, 1 << 30, GEO), DiskSegmentStore(tmp_path, 1 << 30, GEO)
    rec, kv, summ, chain = _segment(7)
    t0 = time.monotonic()
    assert reader.find(chain, 0) is None and time.monotonic() - t0 < 0.5  # nothing announced: no wait
    writer.announce(rec)
    assert isinstance(reader.probe(chain, 1), Announced)  # every chunk announced: a lookup may start anywhere
    timer = threading.Timer(0.3, writer.write, (rec, kv, summ))
    timer.start()
    t0 = time.monotonic()
    found = reader.find(chain, 0)
    timer.join()
    assert found is not None and found.record.seg_id == rec.seg_id and time.monotonic() - t0 >= 0.3
    assert not list((tmp_path / "chunks").glob("*.pending"))  # published: the announcement is gone
    other, _, _, other_chain = _segment(8)
    writer.announce(other)
    t0 = time.monotonic()
    assert reader.find(other_chain, 0, wait_s=0.2) is None and time.monotonic() - t0 >= 0.2  # bounded wait
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = next((tmp_path / "chunks").glob("*.pending"))
    marker.write_text(f"{writer.dir.host} {int(dead.stdout)}")
    DiskSegmentStore(tmp_path, 1 << 30, GEO)  # a worker starting: the dead writer's announcement goes
    assert not marker.exists()


def test_a_writer_withdraws_only_its_own_announcements(tmp_path):
    """Two workers queue writes of overlapping histories: B's withdrawal (its write failed or was
    dropped) leaves A's announced chunks announced (lookups keep waiting for A's write), removes
    B's own; an announcement is never rewritten by a second writer; A's publication clears A's."""
    a, b, reader = (DiskSegmentStore(tmp_path, 1 << 30, GEO) for _ in range(3))
    rec, kv, summ, chain = _segment(11, n_chunks=2)
    tokens = rec.token_ids + [11_999_000 + i for i in range(2 * GEO.chunk_tokens)]  # the same two chunks, then two more
    longer_chain = chunk_chain(tokens, GEO.chunk_tokens, namespace(FORMAT_VERSION, GEO.to_json(), None, None))
    assert longer_chain[:2] == chain
    longer = SegmentRecord(segment_id(0, longer_chain[-1]), None, 0, 4, 0, token_ids=tokens, chunk_hashes=longer_chain)
    pending = lambda h: tmp_path / "chunks" / f"{h}.pending"  # noqa: E731
    a.announce(rec)
    a_marker = pending(chain[0]).read_text()
    b.announce(longer)
    assert pending(chain[0]).read_text() == a_marker  # A's marker, not rewritten by B
    assert os.path.samefile(pending(longer_chain[2]), pending(longer_chain[3]))  # B's own, one file
    assert not os.path.samefile(pending(chain[1]), pending(longer_chain[2]))
    b.unannounce(longer)
    assert all(isinstance(reader.probe(longer_chain, i), Announced) for i in (0, 1))  # A's still waited for
    assert reader.probe(longer_chain, 2) is None and not pending(longer_chain[3]).exists()  # B's gone
    b.announce(rec)  # every name announced already (by A): B has nothing of its own to withdraw
    b.unannounce(rec)
    assert isinstance(reader.probe(chain, 0), Announced)
    a.write(rec, kv, summ)
    assert not list((tmp_path / "chunks").glob("*.pending")) and reader.find(chain, 0) is not None


def test_a_lookup_waits_longer_for_a_longer_announced_segment_and_not_for_a_dead_writer(tmp_path):
    """The wait scales with the tokens the announcement names (a long segment takes longer to
    write, and longer still to recompute), capped; a dead writer on this host is not waited for."""
    from sgl_loopkv.cache import disk_announce

    store = DiskSegmentStore(tmp_path, 1 << 30, GEO)
    me, host = os.getpid(), store.dir.host
    assert store.announcements.wait_budget(f"{host} {me} 0", 0.5) == 0.5
    assert store.announcements.wait_budget(f"{host} {me} 4000", 0.5) == 4000 * disk_announce.PENDING_WAIT_PER_TOKEN_S
    assert store.announcements.wait_budget(f"{host} {me} 10000000", 0.5) == disk_announce.PENDING_WAIT_MAX_S
    assert store.announcements.wait_budget(f"{host} {me}", 0.5) == 0.5  # an older worker's marker: no token count
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert store.announcements.wait_budget(f"{host} {int(dead.stdout)} 4000", 0.5) == 0.0
    assert store.announcements.wait_budget(f"another-host {int(dead.stdout)} 4000", 0.5) == 4.0  # not ours to judge
    rec, _, _, chain = _segment(9)
    store.announce(rec)
    marker = next((tmp_path / "chunks").glob("*.pending")).read_text().split()
    assert marker == [host, str(me), str(len(rec.token_ids))]
    marker_path = next((tmp_path / "chunks").glob("*.pending"))
    marker_path.write_text(f"{host} {int(dead.stdout)} 4000")
    t0 = time.monotonic()
    assert store.find(chain, 0) is None and time.monotonic() - t0 < 0.5  # its writer is gone: no wait
    DiskSegmentStore(tmp_path, 1 << 30, GEO)  # a worker starting removes that announcement
    assert not marker_path.exists()


class _Req:
    """What awaits_write needs of SGLang's Req: a rid, and init_next_round_input matching it."""

    def __init__(self, rid: str, tokens: list[int]):
        self.rid, self.tokens, self.match = rid, tokens, None

    def init_next_round_input(self, cache):
        self.match = cache.match_prefix(MatchPrefixParams(key=RadixKey(self.tokens + [7] * CHUNK, None), req=self))


def test_a_request_whose_history_is_being_written_is_held_back_not_waited_for(tmp_path):
    """The next turn reaches worker B while A's segment of the turn before is only announced: B's
    lookup returns at once (the scheduler thread never sleeps in it) and says to hold the request
    back; once A publishes, the request loads the history; past the announcement's budget it is
    admitted and recomputes. B already holds the history's first chunk (a system prompt that its
    other conversations share), so its lookup starts inside A's segment, not at its first chunk."""
    a, a_alloc = make_cache(tmp_path, host_bytes=1 << 20)
    b, b_alloc = make_cache(tmp_path, host_bytes=1 << 20)
    h = list(range(100, 164))
    b.insert(InsertParams(key=RadixKey(h[:CHUNK], None), value=b_alloc.alloc(CHUNK)))
    key = RadixKey(h, None)
    a.insert(InsertParams(key=key, value=a_alloc.alloc(len(h))))
    a.queue_backup(a.match_prefix(MatchPrefixParams(key=key)).last_device_node, [], None)  # announced only

    req = _Req("turn-2", h)
    t0 = time.monotonic()
    assert b.awaits_write(req) and b.awaits_write(req)  # looked up again each round, still announced
    assert time.monotonic() - t0 < 0.5 and req.match.device_prefix_len == CHUNK
    other = _Req("elsewhere", list(range(900, 964)))
    assert not b.awaits_write(other) and not b.awaits_write(other)  # nothing announced: admitted as usual

    a.flush_pending_backups()  # A's turn published
    a.store.flush()
    deadline = time.monotonic() + 10
    while b.awaits_write(req):  # held while the segment is read on the prefetch thread, then loaded
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert b.store.prefetch.started == 1
    assert req.match.device_prefix_len == len(h) and b.store.stats.hit_tokens["disk"] == len(h) - CHUNK
    assert not list((tmp_path / "chunks").glob("*.pending"))  # every chunk's announcement gone

    h2 = list(range(200, 264))
    key2 = RadixKey(h2, None)
    a.insert(InsertParams(key=key2, value=a_alloc.alloc(len(h2))))
    a.queue_backup(a.match_prefix(MatchPrefixParams(key=key2)).last_device_node, [], None)
    late = _Req("late", h2)
    assert b.awaits_write(late)
    chunk_hash, _, _ = b.requests.get("late").awaiting
    b.requests.get("late").awaiting = (chunk_hash, time.monotonic() - 1, True)  # its wait budget spent
    assert not b.awaits_write(late) and late.match.device_prefix_len == 0  # admitted: recomputed
    assert not b.awaits_write(late)  # and not held back again for the same announcement


def test_the_scheduler_hook_admits_the_others_while_it_holds_a_request_back():
    from sgl_loopkv.cache import awaited

    held, admitted, queued = (SimpleNamespace(rid=x) for x in "abc")
    sched = SimpleNamespace(
        tree_cache=SimpleNamespace(awaits_write=lambda req: req is held), waiting_queue=[held, admitted, queued]
    )
    seen = []

    def get_new_batch_prefill(self, running_batch):
        seen.append(list(self.waiting_queue))
        self.waiting_queue = [r for r in self.waiting_queue if r is not admitted]  # SGLang admits one
        return SimpleNamespace(batch_to_run="batch", running_batch=running_batch)

    plan = awaited.hold_back_awaited(get_new_batch_prefill, sched, SimpleNamespace(is_empty=lambda: True))
    assert plan.batch_to_run == "batch"
    assert seen == [[admitted, queued]] and sched.waiting_queue == [held, queued]  # back at the front

    def nothing_to_run(self, running_batch):
        return SimpleNamespace(batch_to_run=None, running_batch=running_batch)

    sched.waiting_queue = [held]
    t0 = time.perf_counter()
    awaited.hold_back_awaited(nothing_to_run, sched, SimpleNamespace(is_empty=lambda: True))
    assert time.perf_counter() - t0 >= awaited.IDLE_NAP_S and sched.waiting_queue == [held]  # naps, no spin
    sched.tree_cache = SimpleNamespace()  # another radix cache: the call passes through
    sched.waiting_queue = [held, admitted]
    awaited.hold_back_awaited(get_new_batch_prefill, sched, None)
    assert seen[-1] == [held, admitted] and sched.waiting_queue == [held]
