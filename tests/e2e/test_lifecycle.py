"""Stored conversations under the operator's control, in real servers on the tiny model:
``POST /loopkv/forget`` (auth, bad input, by messages, by salt, a shared system prompt kept, two
workers on one disk tier, a restart), checked by what the next identical request reports cached and
by a byte scan of the disk tier's directory."""

from __future__ import annotations

import uuid

import pytest
import requests

from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import ADMIN_KEY, API_KEY, COMMON_SERVER_ARGS
from tests.helpers import files_holding, wait_for_disk

pytestmark = pytest.mark.server

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def story(tag: str, n: int = 14) -> str:
    return " ".join(f"Note {tag}-{j}: shelf {j} of archive {tag} keeps {(j * 5) % 9} maps." for j in range(n))


def messages(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def chat(url: str, msgs: list[dict], headers: dict | None = None, salt: str | None = None) -> int:
    """One greedy turn; -> the cached tokens it reported."""
    model = requests.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    body = {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def forget(url: str, body: dict, headers: dict | None = None) -> requests.Response:
    return requests.post(f"{url}/loopkv/forget", json=body, headers=headers, timeout=120)


def chat_ids(tokenizer, msgs: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in newer transformers


def own_runs(tokenizer, msgs: list[dict]) -> list[list[int]]:
    """Runs of 16 token ids of the user message's own part of the chat prompt (as the server tokenizes it)."""
    ids = chat_ids(tokenizer, msgs)
    sys_only = chat_ids(tokenizer, msgs[:1] + [{"role": "user", "content": "x"}])
    start = next(i for i, (a, b) in enumerate(zip(ids, sys_only)) if a != b)
    return [ids[i : i + 16] for i in range(start + 8, len(ids) - 24, 40)]


def test_forget_refuses_without_the_admin_key_and_bad_input(keyed_server):
    body = {"messages": messages("s", "u")}
    assert forget(keyed_server.url, body).status_code == 401
    assert forget(keyed_server.url, body, USER).status_code == 401  # the admin key is set: only it opens it
    for bad in ({"messages": "hi"}, {"retain": 1}, {}, {"input_ids": [-1]}, {"prompt": "a", "input_ids": [1]}):
        r = forget(keyed_server.url, bad, ADMIN)
        assert r.status_code == 400 and r.json()["message"].startswith("forget"), (bad, r.text)
    r = forget(keyed_server.url, {"messages": messages(story("never"), "unseen")}, ADMIN)
    assert r.status_code == 404, r.text


def test_forget_by_messages_keeps_the_shared_system_prompt(keyed_server, keyed_disk_dir, tokenizer):
    tag = uuid.uuid4().hex[:6]
    system = story(f"sys{tag}", 6)
    a, b = messages(system, story(f"a{tag}")), messages(system, story(f"b{tag}"))
    chat(keyed_server.url, a, USER)
    chat(keyed_server.url, b, USER)
    runs_a, runs_b = own_runs(tokenizer, a), own_runs(tokenizer, b)
    wait_for_disk(keyed_disk_dir, runs_a)
    wait_for_disk(keyed_disk_dir, runs_b)
    r = forget(keyed_server.url, {"messages": a}, ADMIN)
    assert r.status_code == 200, r.text
    removed = r.json()["removed"]
    assert removed["disk"]["segments"] >= 1 and removed["kept_shared_tokens"] > 0, removed
    assert files_holding(keyed_disk_dir, runs_a) == []
    assert files_holding(keyed_disk_dir, runs_b)
    assert chat(keyed_server.url, a, USER) == removed["kept_shared_tokens"]  # only the shared prompt
    assert chat(keyed_server.url, b, USER) >= len(chat_ids(tokenizer, b)) - 16


def test_forget_by_salt(keyed_server, keyed_disk_dir, tokenizer):
    tag = uuid.uuid4().hex[:6]
    a = messages(story(f"salted{tag}", 4), story(f"t{tag}"))
    chat(keyed_server.url, a, USER, salt=f"tenant-{tag}")
    wait_for_disk(keyed_disk_dir, own_runs(tokenizer, a))
    r = forget(keyed_server.url, {"cache_salt": f"tenant-{tag}"}, ADMIN)
    assert r.status_code == 200 and r.json()["removed"]["disk"]["segments"] >= 1, r.text
    assert files_holding(keyed_disk_dir, own_runs(tokenizer, a)) == []
    assert chat(keyed_server.url, a, USER, salt=f"tenant-{tag}") == 0
    assert forget(keyed_server.url, {"cache_salt": f"tenant-{tag}"}, ADMIN).status_code in (200, 404)


# slow: three server starts of its own (the default suite covers forget on one worker)
@pytest.mark.slow
def test_forget_at_one_worker_reaches_the_other_and_survives_a_restart(
    tiny_model_dir, server_logs, tmp_path, tokenizer
):
    """Two workers on one disk tier (what launch_cluster runs behind its router): the conversation that
    worker 2 resumed from worker 1's files is forgotten at worker 1; worker 2's own copies go at its next
    request, and a restarted worker finds nothing either."""
    disk = tmp_path / "kv"
    args = ["--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS, "--loopkv-tier-disk-dir", str(disk)]
    conv = messages(story("cluster-sys", 3), story("cluster-own"))
    runs = own_runs(tokenizer, conv)
    one = ServerProcess(args, log_path=server_logs / "forget-1.log").start()
    try:
        two = ServerProcess(args, log_path=server_logs / "forget-2.log").start()
        try:
            chat(one.url, conv)
            wait_for_disk(disk, runs)
            assert chat(two.url, conv) > 0  # found on the shared tier
            r = forget(one.url, {"messages": conv})  # no keys on these servers: open, as /flush_cache
            assert r.status_code == 200, r.text
            assert files_holding(disk, runs) == []
            assert chat(two.url, conv) == 0  # worker 2's device copy went with worker 1's note
            # worker 2 stored the turn again (on the shared tier too): forgotten at worker 2 this time
            assert forget(two.url, {"messages": conv}).status_code == 200
            assert files_holding(disk, runs) == []
            assert chat(one.url, conv) == 0
        finally:
            two.stop()
        assert forget(one.url, {"messages": conv}).status_code == 200  # the turn just asked was stored again
    finally:
        one.stop()
    three = ServerProcess(args, log_path=server_logs / "forget-3.log").start()
    try:
        assert files_holding(disk, runs) == []
        assert chat(three.url, conv) == 0
    finally:
        three.stop()
