"""The ``loopkv`` body field of generate requests: checked here, carried to the scheduler.

``{"loopkv": {"retain": "pin" | "default" | "none", "ttl": seconds}}`` on ``/generate``,
``/v1/chat/completions`` and ``/v1/completions`` (:mod:`sgl_loopkv.cache.retention` says what it does).
SGLang 0.5.23 drops an unknown field of ``/generate`` (``GenerateReqInput`` is a dataclass) and keeps
one of the OpenAI requests without passing it on, so an ASGI middleware reads the JSON body first:
a malformed hint is a 400 with a message; a good one moves into the request's ``custom_params``
(per ``sampling_params`` for ``/generate``), which SGLang carries to the scheduler's ``Req``
untouched (``custom_params`` is read only by a custom logit processor, and ours is a key of its
own). A hint sent straight in ``custom_params["loopkv"]`` is checked the same way.
"""

from __future__ import annotations

import json

from sgl_loopkv.cache.retention import KEY, parse_hint

PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})


def carry_hint(path: str, body) -> bool:
    """Check and move ``body``'s hint into its ``custom_params`` (edited in place); -> whether it changed.
    Raises ``ValueError`` with a message for the client."""
    if not isinstance(body, dict):
        return False
    params = [body.get("sampling_params")] if path == "/generate" else [body]
    if path == "/generate" and isinstance(params[0], list):
        params = params[0]
    given = [p["custom_params"][KEY] for p in params if _custom(p) and KEY in p["custom_params"]]
    for hint in given:
        parse_hint(hint)
    if KEY not in body:
        return False
    hint = parse_hint(body.pop(KEY))
    wire = {"retain": hint.retain} | ({"ttl": hint.ttl_s} if hint.ttl_s is not None else {})
    if path == "/generate" and body.get("sampling_params") is None:
        body["sampling_params"] = {}
        params = [body["sampling_params"]]
    for p in params:
        if not isinstance(p, dict):
            raise ValueError("sampling_params must be an object (or a list of objects) to carry a loopkv hint")
        if p.get("custom_params") is not None and not isinstance(p["custom_params"], dict):
            raise ValueError("custom_params must be an object")
        p["custom_params"] = {**(p.get("custom_params") or {}), KEY: wire}
    return True


def _custom(p) -> bool:
    return isinstance(p, dict) and isinstance(p.get("custom_params"), dict)


class RetentionHints:
    """ASGI middleware: :func:`carry_hint` on POSTs to :data:`PATHS`; the body is read whole (SGLang reads
    it whole too) and passed on, rewritten where a hint moved. A body that is not JSON goes on as it
    came: SGLang answers it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay(b"", receive, message), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        try:
            if carry_hint(scope["path"], body):
                raw = json.dumps(body).encode()
                scope = dict(scope, headers=_with_length(scope["headers"], len(raw)))
        except ValueError as e:
            return await _bad_request(send, str(e))
        return await self.app(scope, _replay(raw, receive), send)


def _replay(raw: bytes, receive, first=None):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return first or {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


def _with_length(headers, n: int) -> list:
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(n).encode())]


async def _bad_request(send, message: str) -> None:
    body = json.dumps({"object": "error", "message": message, "type": "BadRequestError", "code": 400}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_retention_hints(app) -> None:
    """Add :class:`RetentionHints` to SGLang's FastAPI ``app`` (before it starts)."""
    app.add_middleware(RetentionHints)
