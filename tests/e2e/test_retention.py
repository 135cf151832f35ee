"""Retention hints in a real server (the session's ``keyed_server``: a small device pool, a host tier of
~4 conversations, a disk tier, ``--loopkv-lifecycle-pin-bytes``): malformed hints are 400s, ``retain: none`` reaches
neither the host nor the disk tier, a pinned conversation keeps its host copy under pressure that moves an
unpinned one of the same size out of it, and the answer reports a pin's outcome. Each test uses salts of its own and forgets them at the end."""

from __future__ import annotations

import uuid

import pytest
import requests

from tests.e2e.conftest import ADMIN_KEY, API_KEY
from tests.helpers import files_holding, wait_for_disk

pytestmark = pytest.mark.server

USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def conversation(tag: str, things=("lamps", "books", "cups")) -> str:
    facts = " ".join(f"In story {tag}, room {j} holds {j % 11} {things[j % 3]}." for j in range(70))
    return f"Conversation {tag}. {facts} Question: how many lamps are in room 3?"  # ~900 tokens


def generate(url: str, text: str, salt: str, hint: dict | None = None) -> requests.Response:
    body = {"text": text, "cache_salt": salt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    if hint is not None:
        body["loopkv"] = hint
    return requests.post(f"{url}/generate", json=body, headers=USER, timeout=300)


def tiers(r: requests.Response) -> dict:
    assert r.status_code == 200, r.text
    d = r.json()["meta_info"].get("cached_tokens_details") or {}
    return {"device": d.get("device", 0), "host": d.get("host", 0), "disk": d.get("storage", 0)}


def pin_report(r: requests.Response) -> str | None:
    assert r.status_code == 200, r.text
    return (r.json()["meta_info"].get("cached_tokens_details") or {}).get("pin")


def forget_salt(url: str, salt: str) -> None:
    requests.post(f"{url}/loopkv/forget", json={"cache_salt": salt}, headers=ADMIN, timeout=120)


def _contains(ids: list[int], run: list[int]) -> bool:
    return any(ids[i : i + len(run)] == run for i in range(len(ids) - len(run) + 1))


def runs(tokenizer, text: str) -> list[list[int]]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[i : i + 16] for i in range(40, len(ids) - 40, 60)]


BAD = [
    {"retain": "forever"},
    {"retain": "pin", "ttl": -5},
    {"retain": "pin", "ttl": "soon"},
    {"retain": "none", "ttl": 10},
    {"retain": "pin", "color": "red"},
    "pin",
]


@pytest.mark.parametrize("bad", BAD, ids=[str(b) for b in BAD])
def test_a_malformed_hint_is_a_400_on_generate_and_chat(keyed_server, bad):
    url = keyed_server.url
    r = requests.post(f"{url}/generate", json={"text": "hi", "loopkv": bad}, headers=USER, timeout=60)
    assert r.status_code == 400 and "loopkv" in r.json()["message"], r.text
    model = requests.get(f"{url}/v1/models", headers=USER, timeout=60).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "loopkv": bad}
    r = requests.post(f"{url}/v1/chat/completions", json=chat, headers=USER, timeout=60)
    assert r.status_code == 400 and "loopkv" in r.json()["message"], r.text
    assert requests.get(f"{url}/health", headers=USER, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_retain_none_stores_nothing_in_the_host_or_disk_tier(keyed_server, keyed_disk_dir, tokenizer):
    url, salt = keyed_server.url, f"none-{uuid.uuid4().hex[:8]}"
    secret, control = conversation(f"N{salt}", ("violins", "kettles", "anchors")), conversation(f"D{salt}")
    control_ids = tokenizer(control, add_special_tokens=False)["input_ids"]
    own = [r for r in runs(tokenizer, secret) if not _contains(control_ids, r)]  # the secret's own runs
    assert len(own) >= 5
    try:
        assert tiers(generate(url, secret, salt, {"retain": "none"}))["host"] == 0
        tiers(generate(url, control, salt))  # the same server stores a default request (the check can fail)
        wait_for_disk(keyed_disk_dir, runs(tokenizer, control))
        assert not files_holding(keyed_disk_dir, own)
        again = tiers(generate(url, secret, salt, {"retain": "none"}))
        assert again["host"] == again["disk"] == 0, again
    finally:
        forget_salt(url, salt)


def test_a_pinned_conversation_keeps_its_host_copy_under_pressure(keyed_server):
    url, salt = keyed_server.url, f"pin-{uuid.uuid4().hex[:8]}"
    pinned, plain = conversation(f"P{salt}"), conversation(f"U{salt}")
    try:
        first = generate(url, pinned, salt, {"retain": "pin", "ttl": 300})
        assert pin_report(first) == "pinned", first.json()["meta_info"]
        tiers(generate(url, plain, salt))
        more = [pin_report(generate(url, conversation(f"Q{i}{salt}"), salt, {"retain": "pin"})) for i in range(4)]
        assert set(more) - {"pinned"} <= {"partial", "degraded"} and more[-1] != "pinned", more  # 1 MB of pins
        for i in range(6):  # ~6 conversations of the same size: the host tier holds ~4
            tiers(generate(url, conversation(f"F{i}{salt}"), salt))
        back = tiers(generate(url, pinned, salt))
        other = tiers(generate(url, plain, salt))
        assert back["host"] > 0 and back["disk"] == 0, back  # restored from host memory
        assert other["host"] == 0, other  # moved out of host memory (resumed from disk, or recomputed)
    finally:
        forget_salt(url, salt)
