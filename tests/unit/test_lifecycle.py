"""Retention of the disk tier (``--loopkv-lifecycle-disk-ttl``): the duration flag's parsing, expiry at start-up
and while the store runs (a used segment is kept: every use renews its mtime)."""

from __future__ import annotations

import os
import time

import pytest

from sgl_loopkv.cache.lifecycle_config import parse_duration
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES
from sgl_loopkv.config import LoopKVConfig
from tests.unit.test_forget import SYS, A, B, add_turn
from tests.unit.test_radix_tree import make_cache


@pytest.mark.parametrize(
    ("text", "seconds"), [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("3600s", 3600), ("2.5", 2.5)]
)
def test_durations(text, seconds):
    assert parse_duration(text, "--x") == seconds


@pytest.mark.parametrize("text", ["off", "none", "0", ""])
def test_no_ttl(text):
    assert parse_duration(text, "--x") is None


@pytest.mark.parametrize("text", ["soon", "-3h", "12w", "1e999", "h", "nan"])
def test_nonsense_durations_are_a_clear_error(text):
    with pytest.raises(ValueError, match="--loopkv-lifecycle-disk-ttl must be a duration"):
        LoopKVConfig.from_flat(lifecycle_disk_ttl=text)


def two_stored(tmp_path) -> tuple[str, str]:
    """Histories SYS+A and B stored on disk in ``tmp_path``; -> their segment file names."""
    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    old = add_turn(cache, allocator, SYS + A).lkv[0]
    used = add_turn(cache, allocator, B).lkv[0]
    cache.store.close()
    return f"seg_{old}.kv", f"seg_{used}.kv"


def store(tmp_path, ttl_s: float, geometry) -> TieredKVStore:
    return TieredKVStore(geometry, VALUE_POLICIES.create("lru"), 1 << 20, tmp_path, 1 << 30, disk_ttl_s=ttl_s)


def test_expired_at_start_up_and_the_used_one_kept(tmp_path):
    old, used = two_stored(tmp_path)
    past = time.time() - 7200
    os.utime(tmp_path / old, (past, past))
    geometry = make_cache(tmp_path / "other", host_bytes=1)[0].store_geometry
    s = store(tmp_path, 3600, geometry)
    try:
        assert not (tmp_path / old).exists() and (tmp_path / used).exists()
        assert s.stats.disk_expired == 1
        assert not [f for f in (tmp_path / "chunks").iterdir() if f.stat().st_nlink == 1]  # no dangling links
    finally:
        s.close()


def test_expired_while_running_and_the_tree_is_told(tmp_path):
    old, used = two_stored(tmp_path)
    geometry = make_cache(tmp_path / "other", host_bytes=1)[0].store_geometry
    soon = time.time() + 3600  # "used" stays recently used however slow this machine is right now
    os.utime(tmp_path / used, (soon, soon))
    os.utime(tmp_path / old, (soon, soon))  # not at start-up: by the sweeps
    s = store(tmp_path, 1.0, geometry)  # swept every 0.25 s
    try:
        assert (tmp_path / old).exists()
        os.utime(tmp_path / old, (soon - 7200, soon - 7200))  # last used an hour ago
        deadline = time.monotonic() + 60
        seg_id = old.removeprefix("seg_").removesuffix(".kv")
        while seg_id not in s.writers.evicted:  # queued for sync(), which hands it to the tree
            assert time.monotonic() < deadline, "the unused segment never expired"
            time.sleep(0.05)
        assert not (tmp_path / old).exists() and (tmp_path / used).exists()
    finally:
        s.close()


def test_require_salt_gives_an_unsalted_request_a_namespace_of_its_own(monkeypatch):
    from types import SimpleNamespace

    from sgl_loopkv.server import salt

    monkeypatch.setattr(salt, "_REQUIRED", True)
    a, b = (
        SimpleNamespace(return_logprob=False, cache_salt=None),
        SimpleNamespace(return_logprob=False, cache_salt=None),
    )
    salt.isolate_unsalted(None, a)
    salt.isolate_unsalted(None, b)
    assert a.cache_salt.startswith(salt.UNSALTED) and b.cache_salt.startswith(salt.UNSALTED)
    assert a.cache_salt != b.cache_salt
    tenant = SimpleNamespace(return_logprob=False, cache_salt="tenant-1")
    salt.isolate_unsalted(None, tenant)
    assert tenant.cache_salt == "tenant-1"
    monkeypatch.setattr(salt, "_REQUIRED", False)
    off = SimpleNamespace(return_logprob=False, cache_salt=None)
    salt.isolate_unsalted(None, off)
    assert off.cache_salt is None


def test_an_isolated_request_is_not_stored_in_any_tier(tmp_path):
    from sgl_loopkv.server.salt import UNSALTED

    cache, allocator = make_cache(tmp_path, host_bytes=1 << 20)
    add_turn(cache, allocator, SYS + A, salt=UNSALTED + "x")
    assert not cache.store.segments and not list(tmp_path.glob("seg_*.kv"))
    add_turn(cache, allocator, SYS + B, salt="tenant")
    assert cache.store.segments
