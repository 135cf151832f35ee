"""Helper threads (the loader, the disk writer) run their torch ops without an OpenMP team of their
own: libgomp stops spinning between parallel regions once it manages more threads than there are
CPUs, which made every later decode step slower (issue 13's slowdown after resumes and disk writes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, tempfile, threading, torch
    from pathlib import Path
    from sgl_loopkv.platform import keep_torch_on_this_thread

    def tasks():
        # A set of thread ids, compared by difference: a thread that is still leaving (a joined
        # helper, its team's workers) only ever disappears between two reads, so it cannot count
        # as new; plain counts raced with it under load.
        return set(os.listdir("/proc/self/task"))

    def work():
        x = torch.randn(2_000_000)
        (x * 2).sum()
        torch.zeros(60_000, 3, 64).index_copy_(0, torch.arange(50_000), torch.randn(50_000, 3, 64))

    def threads_added_in_a_thread(keep):
        added = []  # counted inside the helper: its team's workers live as long as it does
        def run():
            if keep:
                keep_torch_on_this_thread()
            n = tasks()
            work()
            added.append(len(tasks() - n))
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return added[0]

    work()  # the main thread's team (torch's intra-op threads)
    out = {"threads": torch.get_num_threads()}
    out["kept"] = threads_added_in_a_thread(keep=True)
    out["plain"] = threads_added_in_a_thread(keep=False)
    out["later_thread_default"] = []
    t = threading.Thread(target=lambda: out["later_thread_default"].append(torch.get_num_threads()))
    t.start()
    t.join()

    from sgl_loopkv.cache.loader import LayerwiseLoader, LoadPart
    bufs = [torch.zeros(60_000, 3, 64) for _ in range(4)]
    loader = LayerwiseLoader(bufs, [b.clone() for b in bufs])
    n = tasks()
    loader.submit([LoadPart(torch.randn(4, 2, 50_000, 3, 64), torch.arange(50_000))])
    loader.wait_all()
    out["loader"] = len(tasks() - n)

    from sgl_loopkv.cache.segment_record import SegmentRecord
    from sgl_loopkv.cache.layout import KVGeometry
    from sgl_loopkv.cache.store import TieredKVStore
    from sgl_loopkv.cache.value import LRUValuePolicy
    g = KVGeometry(num_layers=4, num_kv_heads=3, head_dim=64, dtype=torch.float32, chunk_tokens=16)
    store = TieredKVStore(g, LRUValuePolicy(), 1 << 30, Path(tempfile.mkdtemp()), 1 << 30)
    n = tasks()
    rec = SegmentRecord("a" * 32, None, 0, 256, 0, token_ids=list(range(256 * 16)))
    store.put(rec, torch.randn(4, 2, 256 * 16, 3, 64))
    store.flush()
    out["writer"] = len(tasks() - n)
    print(out)
    """
)


@pytest.fixture(scope="module")
def counts() -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return eval(r.stdout.strip().splitlines()[-1])  # a dict literal printed by the script


def test_a_plain_helper_thread_would_start_a_team(counts):
    """The control: without the call, a helper thread's first parallel op adds OpenMP workers."""
    if counts["threads"] < 2:
        pytest.skip("torch runs one intra-op thread here: no team is ever started")
    assert counts["plain"] > 0


def test_helper_threads_start_no_team_and_leave_the_default_alone(counts):
    assert counts["kept"] == 0
    assert counts["later_thread_default"] == [counts["threads"]]


def test_loader_and_disk_writer_threads_start_no_team(counts):
    assert counts["loader"] == 0
    assert counts["writer"] == 0


def test_a_block_runs_single_threaded_and_the_setting_comes_back():
    """The scheduler thread's bulk copies between forwards (a stored turn's gather) run on that thread
    alone, and its torch threads are what they were afterwards, also after an exception."""
    import os
    import threading

    import torch

    from sgl_loopkv.platform import _gomp, torch_single_threaded, yield_cpu_to_the_forward

    before = torch.get_num_threads()
    with torch_single_threaded():
        inside = torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_single_threaded():
        raise RuntimeError("a failed store")
    assert torch.get_num_threads() == before
    if _gomp() is not None:
        assert inside == 1
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    nice = []

    def helper():
        nice.append(yield_cpu_to_the_forward())
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main  # that thread only
    if nice[0]:  # (an already lower priority cannot be raised without privileges: then left as is)
        assert nice[1] == 10
