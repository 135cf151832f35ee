"""What one request may ask of the server, and a bounded stop (``LimitsConfig``'s flags).

SGLang 0.5.23 accepts any ``n`` and, for an OpenAI request without ``max_tokens``, generates up to
the whole context: one chat request with ``"n": 1000`` queued hours of CPU work, and SIGTERM then
waited for all of it (its ``TokenizerManager.sigterm_watchdog`` drains every request). Two hooks
(SGLang's ``HookRegistry``), no copied SGLang code:

- BEFORE ``TokenizerManager.generate_request``, where every entry point meets (``/generate``, the
  OpenAI endpoints, frontend programs): over-limit requests raise ``ValueError``, which SGLang
  answers with HTTP 400 and the message; a request that sets no ``max_new_tokens`` gets the
  default cap.
- AROUND ``TokenizerManager.sigterm_watchdog``: beside SGLang's drain loop, a task that aborts
  what still runs once the grace period after SIGTERM is over, so the drain ends and the server
  exits (every completed store is already on disk: the disk writer flushes at exit).

In SGLang's subprocesses (scheduler, detokenizer) SIGTERM is ignored
(:func:`leave_sigterm_to_the_launcher`), so a SIGTERM to the whole process group (systemd's default
``KillMode``, ``kill -- -PGID``) stops the server the same way as one to the launcher alone.

And one ASGI middleware, :class:`ClientConcurrencyLimit`, that the launcher adds to SGLang's
FastAPI ``app`` before SGLang adds its own (so SGLang's ``--api-key`` check runs first): requests one
client address has in flight at once, streams counted until they end; one more gets a 429.

All act only in a server started by ``python -m sgl_loopkv.launch_server``; the plugin leaves a
plain ``sglang.launch_server`` in the same environment as SGLang made it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from sgl_loopkv.config import LoopKVConfig

logger = logging.getLogger(__name__)

GENERATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
SIGTERM_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog"


@dataclass(slots=True)
class LimitsConfig:
    """What one request may ask of the server, and how long a stopping server waits for requests; only in
    servers started by this launcher.

    A plain ``sglang.launch_server`` stays as SGLang made it (the module doc says how)."""

    flag_prefix: ClassVar[str] = "limit_"
    title: ClassVar[str] = "request limits"

    max_n: int = field(
        default=8,
        metadata={"help": "Most choices (OpenAI 'n', sampling 'n') one request may ask for; more gets HTTP 400."},
    )
    default_max_tokens: int = field(
        default=1024,
        metadata={
            "help": "Tokens generated for a request that sets no max_tokens or max_new_tokens (SGLang alone would "
            "generate up to the context length); a request may still ask for more, up to the context length."
        },
    )
    max_client_requests: int = field(
        default=64,
        metadata={
            "help": "Requests one client address may have in flight at once (a stream counts until it ends); more "
            "get HTTP 429 (0: no limit). Behind a router every request comes from the router's address: raise it "
            "or set 0 there."
        },
    )
    shutdown_grace_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a server lets running requests finish after SIGTERM before it aborts them and exits "
            "(SGLang alone waits for every queued request)."
        },
    )

    def __post_init__(self):
        if self.max_n < 1 or self.default_max_tokens < 1 or self.shutdown_grace_s < 0 or self.max_client_requests < 0:
            raise ValueError(
                "--loopkv-limit-max-n and --loopkv-limit-default-max-tokens must be >= 1, "
                "--loopkv-limit-shutdown-grace-s and --loopkv-limit-max-client-requests >= 0"
            )


@functools.cache
def active_limits() -> LimitsConfig | None:
    """This server's limits, or None where sgl-loopkv's launcher did not start it."""
    return LoopKVConfig.from_env().limits if LoopKVConfig.launched() else None


def apply_limits(obj, limits: LimitsConfig) -> None:
    """Raise ``ValueError`` when a ``GenerateReqInput`` (before SGLang normalizes it) asks for more
    than ``limits`` allow; give ``max_new_tokens`` the default cap where it is unset (None: the
    OpenAI adapters' spelling of "not given"; a missing key is SGLang's own default, 128)."""
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params] if params is not None else []:
        n = p.get("n")
        if isinstance(n, int) and n > limits.max_n:  # other values are SGLang's to reject
            raise ValueError(f"n={n!r} is over this server's limit of {limits.max_n} (--loopkv-limit-max-n)")
        if "max_new_tokens" in p and p["max_new_tokens"] is None:
            p["max_new_tokens"] = limits.default_max_tokens


def check_generate_request(self, obj, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager.generate_request``."""
    limits = active_limits()
    if limits is not None and hasattr(obj, "return_logprob"):  # GenerateReqInput, not an embedding
        apply_limits(obj, limits)
    return None  # arguments unchanged (``obj`` is edited in place)


async def abort_after_grace(original, self):
    """AROUND hook on ``TokenizerManager.sigterm_watchdog``."""
    limits = active_limits()
    if limits is not None:
        task = asyncio.get_running_loop().create_task(_abort_when_stopping(self, limits.shutdown_grace_s))
        self.asyncio_tasks.add(task)  # SGLang keeps its own tasks there (a reference, and cancelled on exit)
    return await original(self)


def leave_sigterm_to_the_launcher() -> None:
    """Ignore SIGTERM in this SGLang subprocess (call from its main thread, e.g. plugin loading).

    Without it a process-group SIGTERM kills the scheduler and detokenizer at once: running requests
    are cut without the grace period and stores queued for the disk tier are lost. With it the
    launcher stops them as for a SIGTERM to it alone: the grace period, then SGLang's ``ShutdownReq``
    (the scheduler exits normally; the disk writer drains at exit), then SIGKILL for what is left.
    A subprocess whose launcher died still goes: SGLang sets ``PR_SET_PDEATHSIG`` to SIGKILL."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


async def _abort_when_stopping(tokenizer_manager, grace_s: float) -> None:
    while not tokenizer_manager.gracefully_exit:
        await asyncio.sleep(0.5)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while tokenizer_manager.rid_to_state and loop.time() < deadline:
        await asyncio.sleep(0.25)
    if tokenizer_manager.rid_to_state:
        logger.warning(
            "stopping: aborting %d request(s) still running %.0f s after SIGTERM (--loopkv-limit-shutdown-grace-s)",
            len(tokenizer_manager.rid_to_state),
            grace_s,
        )
        tokenizer_manager.abort_request(abort_all=True)


#: Paths a monitor polls: never counted, never refused.
UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})


class ClientConcurrencyLimit:
    """ASGI middleware: at most ``max_requests`` HTTP requests in flight per client address (the
    peer address: behind a proxy or router that is the proxy's). A request is in flight from its
    arrival until its response's last byte is sent (a stream's end) or the app returns (a client
    that went away). Over the limit: 429 with a JSON error naming the flag, and ``Retry-After``."""

    def __init__(self, app, max_requests: int):
        self.app, self.max_requests = app, max_requests
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            return await self.app(scope, receive, send)
        peer = scope.get("client")
        client = peer[0] if peer else "unknown"
        if self.in_flight[client] >= self.max_requests:
            if peer and _from_this_process(peer):  # SGLang's own warm-up request: never refused
                return await self.app(scope, receive, send)
            return await _too_many(send, self.max_requests)
        self.in_flight[client] += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight[client] -= 1
                if not self.in_flight[client]:
                    del self.in_flight[client]

        async def send_and_release(message):
            # The request ends with its response's last byte: the app may return much later (an
            # SGLang stream's handler lingers after the end), and counting until then leaked slots.
            try:
                await send(message)
            finally:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    release()

        try:
            await self.app(scope, receive, send_and_release)
        finally:
            release()


def _from_this_process(peer: tuple[str, int]) -> bool:
    """Whether the peer ``(host, port)`` is a socket of this very process. SGLang's HTTP server sends
    its start-up warm-up request to itself from loopback, and a refused warm-up makes SGLang kill
    the server; with other loopback requests in flight at that moment (a readiness probe, a local
    client retrying) the limit refused it (seen with a limit of 1 in the test suite). Asked only
    when a request would be refused, so the scan of this process's sockets (~1 ms) is off the
    common path."""
    import psutil

    host, port = peer[0], peer[1]
    try:
        return any(
            c.laddr and c.laddr.port == port and c.laddr.ip == host for c in psutil.Process().net_connections("tcp")
        )
    except psutil.Error:
        return False


async def _too_many(send, limit: int) -> None:
    message = (
        f"this client already has {limit} requests in flight, the server's limit "
        "(--loopkv-limit-max-client-requests); retry when one has finished"
    )
    body = json.dumps({"object": "error", "message": message, "type": "TooManyRequests", "code": 429}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 429, "headers": [*headers, (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


def install_http_limits(app, limits: LimitsConfig) -> None:
    """Add :class:`ClientConcurrencyLimit` to SGLang's FastAPI ``app`` (before it starts)."""
    if limits.max_client_requests:
        app.add_middleware(ClientConcurrencyLimit, max_requests=limits.max_client_requests)
