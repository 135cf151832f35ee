"""Per-request limits (server/limits.py) on SGLang's un-normalized request objects; the live-server
side (400s, the cap, SIGTERM, plain SGLang untouched) is tests/e2e/test_limits.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_loopkv.config import ENV_VAR, LoopKVConfig
from sgl_loopkv.server import limits
from sgl_loopkv.server.limits import LimitsConfig

LIMITS = LimitsConfig(max_n=2, default_max_tokens=5)


def request(sampling_params):
    return SimpleNamespace(sampling_params=sampling_params, return_logprob=False)


@pytest.mark.parametrize("params", [{"n": 3}, [{"n": 3}, {"n": 3}], {"n": 1000, "max_new_tokens": 1}])
def test_n_over_the_limit_is_refused_with_the_flag_named(params):
    with pytest.raises(ValueError, match="--loopkv-limit-max-n"):
        limits.apply_limits(request(params), LIMITS)


def test_the_cap_fills_only_an_unset_max_new_tokens():
    unset, explicit, absent = {"max_new_tokens": None, "n": 2}, {"max_new_tokens": 50}, {}
    for params in (unset, [explicit, absent], None):
        limits.apply_limits(request(params), LIMITS)
    # absent is SGLang's own default (128), not "unbounded": left to SGLang
    assert unset["max_new_tokens"] == 5 and explicit["max_new_tokens"] == 50 and absent == {}


def test_only_servers_started_by_the_launcher_are_limited(monkeypatch):
    limits.active_limits.cache_clear()
    monkeypatch.delenv(ENV_VAR, raising=False)
    params = {"n": 1000, "max_new_tokens": None}
    limits.check_generate_request(None, request(params))  # plain sglang.launch_server: untouched
    assert params == {"n": 1000, "max_new_tokens": None}
    LoopKVConfig(limits=LIMITS).to_env()
    limits.active_limits.cache_clear()
    try:
        with pytest.raises(ValueError, match="over this server's limit of 2"):
            limits.check_generate_request(None, request(params))
    finally:
        monkeypatch.delenv(ENV_VAR)
        limits.active_limits.cache_clear()


def test_client_concurrency_limit_refuses_one_more_per_client_until_one_ends():
    import asyncio

    release = asyncio.Event()

    async def app(scope, receive, send):  # a request that runs until released
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = limits.ClientConcurrencyLimit(app, max_requests=2)

    async def call(client: str, path: str = "/generate") -> tuple[int, bytes]:
        sent = []

        async def send(msg):
            sent.append(msg)

        await guard({"type": "http", "path": path, "client": (client, 1)}, None, send)
        return sent[0]["status"], sent[-1].get("body", b"")

    async def main():
        running = [asyncio.create_task(call("10.0.0.1")) for _ in range(2)]
        other = asyncio.create_task(call("10.0.0.2"))  # another client is not affected
        health = asyncio.create_task(call("10.0.0.1", "/health"))  # monitors never counted
        await asyncio.sleep(0.05)
        status, body = await asyncio.wait_for(call("10.0.0.1"), 5)  # refused at once, not queued
        assert status == 429 and b"--loopkv-limit-max-client-requests" in body
        release.set()
        assert [(await t)[0] for t in (*running, other, health)] == [200] * 4
        assert (await call("10.0.0.1"))[0] == 200 and not guard.in_flight

    asyncio.run(main())


def test_a_request_stops_counting_at_its_responses_last_byte():
    """SGLang's streaming handlers return well after the stream's end: counting until the app returns
    leaked slots (a soak at 32 clients got 429s under a limit of 64)."""
    import asyncio

    linger = asyncio.Event()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: [DONE]", "more_body": False})
        await linger.wait()  # still running after the response ended

    guard = limits.ClientConcurrencyLimit(app, max_requests=1)

    async def send(msg):
        pass

    async def main():
        first = asyncio.create_task(guard({"type": "http", "path": "/generate", "client": ("c", 1)}, None, send))
        await asyncio.sleep(0.05)
        assert not guard.in_flight  # released at the last byte
        linger.set()
        await first
        assert not guard.in_flight  # and not twice

    asyncio.run(main())


def test_the_servers_own_warm_up_request_is_never_refused():
    """SGLang's HTTP server warms itself up with a request from loopback and kills the server when it
    is refused; a readiness probe in flight from the same address made a limit of 1 refuse it."""
    import asyncio
    import socket

    release = asyncio.Event()

    async def app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = limits.ClientConcurrencyLimit(app, max_requests=1)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as own:
        own_peer = own.getsockname()  # what the server sees as the client of a request this process sends

        async def call(peer) -> int:
            sent = []

            async def send(msg):
                sent.append(msg)

            await guard({"type": "http", "path": "/generate", "client": peer}, None, send)
            return sent[0]["status"]

        async def main():
            probe = asyncio.create_task(call(("127.0.0.1", 1)))  # another loopback client holds the slot
            await asyncio.sleep(0.05)
            assert await asyncio.wait_for(call(("127.0.0.1", 2)), 5) == 429  # a stranger is refused
            warm_up = asyncio.create_task(call(own_peer))
            await asyncio.sleep(0.05)
            release.set()
            assert [await probe, await warm_up] == [200, 200]
            assert not guard.in_flight

        asyncio.run(main())
