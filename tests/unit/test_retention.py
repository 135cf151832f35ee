"""Retention hints, pins and tenant shares without a server: the hint's checks, the HTTP layer's
rewrite, and the host/disk tiers' eviction order under pins and shares (cache.retention)."""

from __future__ import annotations

import json

import pytest

from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.lifecycle_config import LifecycleConfig
from sgl_loopkv.cache.retention import (
    TENANT_BUCKETS,
    Retention,
    RetentionBook,
    parse_hint,
    pin_outcome,
    tenant_label,
)
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES
from sgl_loopkv.server.retention import RetentionHints, carry_hint
from tests.unit.test_cache_store import GEO, segment

ONE = GEO.segment_host_bytes(4)  # host bytes of a 4-chunk segment (and its summaries)


def _seg(seed: int, salt: str | None = None):
    rec, kv, summ = segment(4, seed)
    rec.cache_salt = salt
    return rec, kv, summ


@pytest.mark.parametrize(
    "bad",
    [
        "pin",
        {"retain": "forever"},
        {"retain": "pin", "ttl": -1},
        {"retain": "pin", "ttl": 0},
        {"retain": "pin", "ttl": "10"},
        {"retain": "pin", "ttl": True},
        {"retain": "pin", "ttl": float("nan")},
        {"retain": "pin", "ttl": 1e12},
        {"retain": "default", "ttl": 5},
        {"retain": "pin", "priority": 1},
    ],
)
def test_a_malformed_hint_is_refused_with_a_message(bad):
    with pytest.raises(ValueError, match="loopkv"):
        parse_hint(bad)


def test_good_hints_parse():
    assert parse_hint(None) == parse_hint({}) == Retention("default")
    assert parse_hint({"retain": "none"}) == Retention("none")
    assert parse_hint({"retain": "pin", "ttl": 30}) == Retention("pin", 30.0)


def test_the_hint_moves_into_custom_params_on_each_endpoint():
    gen = {"text": "hi", "sampling_params": [{"max_new_tokens": 2}, {}], "loopkv": {"retain": "none"}}
    assert carry_hint("/generate", gen) and "loopkv" not in gen
    assert [p["custom_params"]["loopkv"] for p in gen["sampling_params"]] == [{"retain": "none"}] * 2
    bare = {"text": "hi", "loopkv": {"retain": "pin", "ttl": 9}}
    assert carry_hint("/generate", bare) and bare["sampling_params"]["custom_params"]["loopkv"]["ttl"] == 9.0
    chat = {"messages": [], "custom_params": {"x": 1}, "loopkv": {"retain": "pin"}}
    assert carry_hint("/v1/chat/completions", chat) and chat["custom_params"] == {"x": 1, "loopkv": {"retain": "pin"}}
    assert not carry_hint("/v1/chat/completions", {"messages": []})
    with pytest.raises(ValueError, match="retain"):  # sent straight in custom_params: checked too
        carry_hint("/v1/chat/completions", {"custom_params": {"loopkv": {"retain": "x"}}})


async def _call(body: bytes, path="/generate"):
    seen, sent = {}, []

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", b"1")]}
    await RetentionHints(app)(scope, receive, send)
    return seen.get("body"), sent


def test_the_middleware_answers_400_or_passes_the_rewritten_body():
    import asyncio

    passed, sent = asyncio.run(_call(json.dumps({"text": "a", "loopkv": {"retain": "maybe"}}).encode()))
    assert passed is None and sent[0]["status"] == 400 and b"retain" in sent[1]["body"]
    passed, sent = asyncio.run(_call(json.dumps({"text": "a", "loopkv": {"retain": "none"}}).encode()))
    assert not sent and json.loads(passed)["sampling_params"]["custom_params"] == {"loopkv": {"retain": "none"}}
    passed, _ = asyncio.run(_call(b"not json"))
    assert passed == b"not json"  # SGLang's to answer


def test_a_pinned_segment_survives_pressure_that_evicts_an_unpinned_one():
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), 2 * ONE, retention=RetentionBook(pin_bytes=ONE))
    pinned, plain = _seg(1), _seg(2)
    assert store.put(*pinned) and store.put(*plain)
    assert store.pin(pinned[0].seg_id, ttl_s=None)
    for i in range(3, 8):  # newer segments of the same size push the older ones out
        store.put(*_seg(i))
    assert store.tier_of(pinned[0].seg_id) == "host"
    assert store.tier_of(plain[0].seg_id) is None
    assert store.count_tokens().pinned_bytes == ONE


def test_a_pin_over_the_quota_is_degraded_and_counted_and_a_ttl_ends_a_pin():
    now = [0.0]
    book = RetentionBook(pin_bytes=ONE, clock=lambda: now[0])
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), 2 * ONE, retention=book)
    a, b = _seg(1), _seg(2)
    store.put(*a), store.put(*b)
    assert store.pin(a[0].seg_id, ttl_s=10)
    assert not store.pin(b[0].seg_id, ttl_s=10) and book.refused == 1  # stored, not pinned
    now[0] = 11.0
    assert not book.pinned(a[0].seg_id) and book.pinned_bytes == 0
    for i in range(3, 6):
        store.put(*_seg(i))
    assert store.tier_of(a[0].seg_id) is None  # evicted like any other once the pin ended


def test_a_flooding_tenant_evicts_its_own_entries_first():
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), 4 * ONE, retention=RetentionBook(host_share=0.5))
    quiet = [_seg(1, "b"), _seg(2, "b")]
    for s in quiet:
        store.put(*s)
    for i in range(10, 30):  # tenant a floods; b's two segments are within its share
        store.put(*_seg(i, "a"))
    assert all(store.tier_of(s[0].seg_id) == "host" for s in quiet)
    usage = store.tenant_usage()
    assert usage[("host", tenant_label("a"))][1] <= 2 * ONE


def test_without_shares_the_flood_evicts_the_older_tenant():  # the baseline the share changes
    store = TieredKVStore(GEO, VALUE_POLICIES.create("lru"), 4 * ONE)
    quiet = _seg(1, "b")
    store.put(*quiet)
    for i in range(10, 30):
        store.put(*_seg(i, "a"))
    assert store.tier_of(quiet[0].seg_id) is None


def test_a_disk_share_keeps_a_flooding_tenant_to_its_share(tmp_path):
    file_bytes = DiskSegmentStore(tmp_path / "est", 0, GEO).file_bytes(4, 64)
    store = TieredKVStore(
        GEO,
        VALUE_POLICIES.create("lru"),
        ONE,
        tmp_path / "d",
        4 * file_bytes,
        retention=RetentionBook(disk_share=0.5),
    )
    quiet = _seg(1, "b")
    store.put(*quiet)
    store.flush()
    for i in range(10, 20):
        store.put(*_seg(i, "a"))
        store.flush()
    store.sync()
    assert store.tier_of(quiet[0].seg_id) in ("host", "disk") and store.segments[quiet[0].seg_id].on_disk
    assert store.tenant_usage()[("disk", tenant_label("a"))][1] <= 2 * file_bytes


def test_tenant_labels_are_bounded_and_hide_the_salt():
    labels = {tenant_label(f"salt-{i}") for i in range(500)}
    assert len(labels) == TENANT_BUCKETS and not any("salt" in x for x in labels)
    assert tenant_label("default") == "default"


@pytest.mark.parametrize("bad", [{"pin_bytes": -1}, {"tenant_host_share": 0}, {"tenant_disk_share": 1.5}])
def test_bad_retention_flags_are_start_up_errors(bad):
    with pytest.raises(ValueError, match="--loopkv-"):
        LifecycleConfig(**bad)


def test_a_pin_reports_its_outcome():
    assert pin_outcome([True, True]) == "pinned"
    assert pin_outcome([True, False]) == "partial"
    assert pin_outcome([False]) == pin_outcome([]) == "degraded"
