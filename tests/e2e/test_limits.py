"""What one request may ask (``--loopkv-limit-max-n``, ``--loopkv-limit-default-max-tokens``), the bounded stop
after SIGTERM (``--loopkv-limit-shutdown-grace-s``), and a plain ``sglang.launch_server`` in the same
environment left as SGLang made it (server/limits.py, issue 16)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.e2e.conftest import CAP, GRACE_S, MAX_N
from tests.helpers import stream_in_background

pytestmark = pytest.mark.server


def chat(url: str, **body) -> requests.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": "count"}], "ignore_eos": True, **body}
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_n_over_the_limit_gets_a_400_with_the_flag_named(capped_server):
    r = chat(capped_server.url, n=MAX_N + 1, max_tokens=1)
    assert r.status_code == 400 and "--loopkv-limit-max-n" in r.text, r.text
    r = requests.post(
        f"{capped_server.url}/generate",
        json={"text": "hi", "sampling_params": {"n": 1000, "max_new_tokens": 1}},
        timeout=120,
    )
    assert r.status_code == 400 and "--loopkv-limit-max-n" in r.text, r.text
    r = chat(capped_server.url, n=MAX_N, max_tokens=1)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N


def test_a_request_without_max_tokens_gets_the_default_cap_and_may_ask_for_more(capped_server):
    r = chat(capped_server.url)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP, r.text
    r = chat(capped_server.url, max_tokens=CAP + 2)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP + 2, r.text


def test_a_client_over_its_concurrency_limit_gets_a_429_until_its_stream_ends(capped_server):
    body = {"text": "go", "stream": True, "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}
    with requests.post(f"{capped_server.url}/generate", json=body, stream=True, timeout=120) as streaming:
        next(line for line in streaming.iter_lines() if line.startswith(b"data: {"))  # it is generating
        r = chat(capped_server.url, max_tokens=1)
        assert r.status_code == 429 and "--loopkv-limit-max-client-requests" in r.json()["message"], r.text
        assert requests.get(f"{capped_server.url}/health", timeout=30).status_code == 200
    # the client hung up mid-stream: SGLang aborts the request and the slot is free again
    deadline = time.monotonic() + 60
    while (r := chat(capped_server.url, max_tokens=1)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert r.status_code == 200, r.text


def test_sigterm_aborts_what_still_runs_after_the_grace_period_and_exits(capped_server):
    """Last in this module: it stops the server. A request that would run for minutes must not
    keep a stopping server alive (SGLang alone waits for every request)."""
    t, finish = stream_in_background(capped_server.url, 7000)
    t0 = time.monotonic()
    os.kill(capped_server.proc.pid, signal.SIGTERM)  # the launcher only, as systemd or docker stop do
    capped_server.proc.wait(timeout=90)
    exited_s = time.monotonic() - t0
    t.join(timeout=30)
    assert not t.is_alive()
    assert finish["completion_tokens"] < 7000 and finish["finish_reason"]["type"] == "abort", finish
    assert exited_s < GRACE_S + 40, exited_s  # SGLang's own drain loop polls every 5 s
    # A log check on purpose: the server has exited (no endpoint is left to ask), the abort itself is held
    # above by the stream's finish_reason, and the point here is the operator's message that names the flag
    # (docs/operating/faults.md quotes it).
    assert "still running" in capped_server.log_path.read_text()


def test_plain_sglang_keeps_its_own_behaviour(tiny_native_server):
    """No model-name check, no n limit, no default cap: the plugin only registers its components
    (``tiny_native_server`` is a plain ``sglang.launch_server``)."""
    r = chat(tiny_native_server.url, model="no-such-model", n=MAX_N + 3, max_tokens=1)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N + 3, r.text
