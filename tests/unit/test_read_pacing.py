"""A read-ahead gives way to the running requests (cache/read_pacing.py): while the scheduler says
others run, a paced reader naps after each piece in proportion to its CPU; idle it never naps; a
thread that did not install a pacing (an inline read on the scheduler thread) never naps; and a
paced read returns exactly what an unpaced one does."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from sgl_loopkv.cache import awaited, read_pacing
from sgl_loopkv.cache.read_pacing import ReadPacing
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES
from tests.unit.test_cache_store import GEO, segment


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _on_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_busy_paced_reader_naps_in_proportion_to_its_cpu_and_an_idle_one_does_not():
    pacing = ReadPacing(duty=0.25)

    def work(busy: bool) -> tuple[float, float]:
        pacing.install()
        pacing.set_busy(busy)
        t0, naps0 = time.perf_counter(), pacing.nap_seconds
        for _ in range(5):
            _spin(0.004)
            read_pacing.checkpoint()
        return time.perf_counter() - t0, pacing.nap_seconds - naps0

    wall, napped = _on_thread(lambda: work(True))
    assert napped >= 5 * 0.004 * 3 * 0.9 and wall >= napped  # 3x the CPU of each piece at a quarter duty
    wall, napped = _on_thread(lambda: work(False))
    assert napped == 0 and wall < 0.2


def test_a_thread_without_pacing_never_naps():
    pacing = ReadPacing()
    pacing.set_busy(True)  # installed on no thread

    def work() -> int:
        _spin(0.004)
        read_pacing.checkpoint()
        return pacing.naps

    assert _on_thread(work) == 0


def test_a_paced_read_ahead_returns_what_an_inline_read_does(tmp_path):
    one = GEO.segment_host_bytes(4)
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), one, tmp_path, 1 << 30)
    segs = [segment(4, 600 + i) for i in range(2)]
    for rec, kv, summ in segs:
        store.put(rec, kv, summ)
    store.flush()
    first = segs[0][0].seg_id
    assert store.tier_of(first) == "disk"
    store.pace_reads(True)
    old = read_pacing.PIECE_BYTES
    read_pacing.PIECE_BYTES = 4096  # many pieces even for a small segment
    try:
        store.read_ahead(first)
        kv, tier = store.fetch(first, 0, 4)
    finally:
        read_pacing.PIECE_BYTES = old
    assert tier == "disk" and torch.equal(kv, segs[0][1]) and store.prefetch.pacing.naps > 0
    stats = store.count_tokens()  # what /metrics publishes (loopkv_read_ahead_naps, loopkv_disk_seconds{part="nap"})
    assert stats.read_naps == store.prefetch.pacing.naps and stats.read_nap_seconds > 0
    store.close()


def test_the_hold_back_hook_says_whether_others_run():
    said = []
    held = SimpleNamespace(rid="held")
    sched = SimpleNamespace(
        tree_cache=SimpleNamespace(awaits_write=lambda req: req is held, pace_reads=said.append), waiting_queue=[held]
    )

    def round_(running_empty: bool, batch):
        def get_new_batch_prefill(self, running_batch):
            return SimpleNamespace(batch_to_run=batch, running_batch=running_batch)

        awaited.hold_back_awaited(get_new_batch_prefill, sched, SimpleNamespace(is_empty=lambda: running_empty))

    round_(False, None)  # a decode runs beside the held request
    round_(True, "a prefill")  # another request's prefill
    round_(True, None)  # nothing but the held request
    assert said == [True, True, False]


def test_the_reader_is_lowered_only_while_others_run_and_stays_lowered_where_it_cannot_rise(monkeypatch):
    monkeypatch.setattr(read_pacing, "_local", threading.local())  # install() below is this thread's only
    calls = []
    monkeypatch.setattr(read_pacing, "thread_priority", lambda: 3)
    monkeypatch.setattr(read_pacing, "yield_cpu_to_the_forward", lambda: calls.append("lower") or True)
    allowed = [True]
    monkeypatch.setattr(read_pacing, "take_cpu_back", lambda nice: calls.append(("raise", nice)) or allowed[0])
    pacing = ReadPacing()
    pacing.install(by_priority=True)
    assert calls == ["lower"]  # a new reader starts lowered
    for busy in (True, False, False, True, True, False):
        pacing.set_busy(busy)
        pacing.pace()
    assert calls == ["lower", ("raise", 3), "lower", ("raise", 3)]  # one call per change, back to its own nice
    allowed[0] = False  # no CAP_SYS_NICE: the first refusal keeps it lowered, and it stops asking
    for busy in (True, False, False, True, False):
        pacing.set_busy(busy)
        pacing.pace()
    assert calls[4:] == ["lower", ("raise", 3)]
    plain = ReadPacing()
    plain.install()  # pacing without priorities (LOOPKV_READ_AHEAD_NICE=0): never touched
    plain.set_busy(True)
    plain.pace()
    assert len(calls) == 6
