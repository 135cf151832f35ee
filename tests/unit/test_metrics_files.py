"""A scrape of ``/metrics`` while a process is creating its metrics file (server/metrics_files.py),
on real prometheus_client files merged the way SGLang's ``/metrics`` merges them."""

from __future__ import annotations

import functools
import inspect
import struct

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from sgl_loopkv.server import metrics_files


def original_reader():
    """prometheus_client's own reader, also once hooked (not a module global: HookRegistry rebinds
    every module-level name bound to a function it wraps)."""
    return inspect.unwrap(MmapedDict.read_all_values_from_file)


@pytest.fixture
def scrape_dir(tmp_path):
    """One process's gauge, and another process's file between its creation and its sizing."""
    d = MmapedDict(str(tmp_path / "gauge_mostrecent_100.db"))
    key = mmap_key("loopkv_tier_bytes", "loopkv_tier_bytes", ["tier"], ["host"], "Bytes held per tier")
    d.write_value(key, 1234.0, 1.0e9)
    d.close()
    (tmp_path / "counter_101.db").touch()
    return tmp_path


def scrape(path) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in MultiProcessCollector(None, path=str(path)).collect()
        for s in m.samples
    }


def test_prometheus_client_still_fails_on_an_empty_file(scrape_dir, monkeypatch):
    """The upstream bug the hook is for (prometheus/client_python#1199). When this fails,
    prometheus_client reads empty files by itself: drop server/metrics_files.py and its hook."""
    monkeypatch.setattr(MmapedDict, "read_all_values_from_file", staticmethod(original_reader()))
    with pytest.raises(struct.error):
        scrape(scrape_dir)


def test_the_hook_reads_an_empty_file_as_nothing_recorded(scrape_dir, monkeypatch):
    hooked = functools.partial(metrics_files.read_values_of_sized_file, original_reader())  # as HookRegistry's AROUND
    monkeypatch.setattr(MmapedDict, "read_all_values_from_file", staticmethod(hooked))
    assert scrape(scrape_dir) == {("loopkv_tier_bytes", (("tier", "host"),)): 1234.0}
    # A sized file that is damaged still fails as loudly as before.
    (scrape_dir / "counter_101.db").write_bytes(struct.pack("<i", 64) + b"\0" * 4 + struct.pack("<i", 999) + b"x" * 4)
    with pytest.raises(RuntimeError, match="corrupted"):
        scrape(scrape_dir)


def test_mounting_metrics_wraps_the_reader_once(scrape_dir):
    """What SGLang's add_prometheus_middleware triggers in each HTTP process (twice: a second app)."""
    original = original_reader()
    metrics_files.hook_reader_on_mount(object())
    metrics_files.hook_reader_on_mount(object())
    assert MmapedDict.read_all_values_from_file.__wrapped__ is original
    assert scrape(scrape_dir) == {("loopkv_tier_bytes", (("tier", "host"),)): 1234.0}
