"""Error answers of the HTTP API: bad input gets a readable 4xx, never a 5xx, a cut stream or a path
of the server's files. What ``benchmarks/studies/fuzz.py`` found in SGLang 0.5.23 (with FastAPI 0.165):

- FastAPI puts the endpoint's source location (``File "/…/http_server.py", line N, in …``) into the
  text of every ``RequestValidationError``, and SGLang's handler sends that text as the 400's
  message. :func:`wrap_validation_handler` gives SGLang's handler the same errors without it, and a
  first sentence that says what is wrong in words.
- SGLang rejects bad input by raising ``ValueError`` (its ``/generate`` and OpenAI handlers answer it
  400), but several endpoints let it escape (Ollama, Vertex, ``/separate_reasoning``,
  ``/parse_function_call``, ``/v1/loads``, ...): a 500, or a stream already answered 200 cut
  mid-body. A JSON body that is not an object (``[1, 2]``) makes a ``mode="before"`` validator of
  SGLang's request models raise ``AttributeError`` while FastAPI validates the body: a 500.
  :class:`BadInputGuard` answers these 400 (inside a started stream: one last error record, then a
  clean end) and lets every other exception through, so a real server fault stays a 500.
- SGLang disables the Responses API at start when an optional dependency is missing but keeps its
  routes, which then fail with a 500; the guard answers them 404.

Installed on SGLang's FastAPI ``app`` by an AROUND hook on ``http_server.launch_server`` (in the
launcher process, before uvicorn serves), in servers started by sgl-loopkv's launcher only. With
``--tokenizer-worker-num > 1`` uvicorn's workers import a fresh ``app`` that has none of this.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

LAUNCH_TARGET = "sglang.srt.entrypoints.http_server.launch_server"
#: Routes of SGLang's Responses API, and the ``app.state`` attribute its start-up sets when it works.
RESPONSES_PREFIX, RESPONSES_STATE = "/v1/responses", "openai_serving_responses"
#: Where FastAPI validates a request body against the endpoint's model: an exception raised inside
#: it is caused by the body (the fuzz test notices when a FastAPI upgrade renames it: a 500 again).
BODY_VALIDATION_FRAME = ("fastapi.dependencies.utils", "request_body_to_args")
NOT_AN_OBJECT = "The request body must be a JSON object with this endpoint's fields (see GET /openapi.json)."


@functools.cache
def _path_pattern() -> re.Pattern:
    """Absolute paths of the server's own files: the Python environment, the working directory, the
    home directory (model cache); longest first, so the most specific prefix wins."""
    roots = {sys.prefix, sys.base_prefix, os.getcwd(), str(Path.home()), str(Path(__file__).resolve().parents[1])}
    roots = sorted((r for r in roots if len(r) > 1), key=len, reverse=True)
    return re.compile("|".join(re.escape(r) + r"(?:/[^\s'\"]*)?" for r in roots))


def scrub(text: str) -> str:
    """``text`` with every path of the server's files replaced by ``<server path>``."""
    return _path_pattern().sub("<server path>", text)


def readable_errors(errors) -> str:
    """One sentence per pydantic/FastAPI error: ``body.messages.0.content: Input should be ...``."""
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = e.get("msg", "invalid")
        detail = (e.get("ctx") or {}).get("error")
        parts.append(f"{loc}: {msg}" + (f" ({detail})" if isinstance(detail, str) and detail else ""))
    return "Invalid request. " + "; ".join(parts) + "."


def wrap_validation_handler(handler):
    """SGLang's ``RequestValidationError`` handler, given the error without FastAPI's endpoint
    context (a server file path and line) and with :func:`readable_errors` as its text."""
    from fastapi.exceptions import RequestValidationError

    class ReadableValidationError(RequestValidationError):
        def __str__(self) -> str:
            return readable_errors(self.errors())

    @functools.wraps(handler)
    async def validation_error(request, exc):
        return await handler(request, ReadableValidationError(exc.errors(), body=getattr(exc, "body", None)))

    return validation_error


def _innermost(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # anyio task groups wrap
        exc = exc.exceptions[0]
    return exc


def _raised_validating_body(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == BODY_VALIDATION_FRAME:
            return True
        tb = tb.tb_next
    return False


def bad_input_message(exc: BaseException) -> str | None:
    """The 400 message for an exception that escaped an endpoint because of the request, or None
    where it is not known to be the request's fault (it then stays a 500)."""
    exc = _innermost(exc)
    if _raised_validating_body(exc):
        return NOT_AN_OBJECT
    if isinstance(exc, ValueError):  # SGLang's "bad request" (pydantic's ValidationError is one too)
        return scrub(str(exc)) or type(exc).__name__
    if isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc):  # a request built with **body
        return scrub(str(exc))
    return None


def error_body(status: int, message: str) -> bytes:
    """SGLang's error shape (``ErrorResponse``): what its own handlers send."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "Error")
    return json.dumps({"object": "error", "message": message, "type": kind, "param": None, "code": status}).encode()


def stream_error_record(content_type: str, message: str) -> bytes:
    """The last record of a stream that failed after its 200: an SSE event as SGLang's streams send
    errors, or an NDJSON line as Ollama does."""
    if "text/event-stream" in content_type:
        err = {"message": message, "type": "invalid_request_error", "code": 400}
        return b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
    return json.dumps({"error": message}).encode() + b"\n"


async def _send_error(send, status: int, message: str) -> None:
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BadInputGuard:
    """ASGI middleware: exceptions that escape SGLang's endpoints because of the request become a
    400 (see :func:`bad_input_message`); the disabled Responses API answers 404."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path.startswith(RESPONSES_PREFIX) and "app" in scope and not hasattr(scope["app"].state, RESPONSES_STATE):
            msg = "The Responses API (/v1/responses) is not available on this server: it failed to start (see its log)."
            return await _send_error(send, 404, msg)
        started: list[str] = []  # the response's content type, once its start is sent
        finished = False

        async def tracking_send(message):
            nonlocal finished
            if message["type"] == "http.response.start":
                started.append(dict(message.get("headers") or []).get(b"content-type", b"").decode("latin-1"))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            message = bad_input_message(exc)
            if message is None or finished:
                raise
            logger.info("%s %s: bad input answered 400: %s", scope.get("method"), path, message)
            if not started:
                await _send_error(send, 400, message)
            else:
                await send({"type": "http.response.body", "body": stream_error_record(started[0], message)})


def install(app) -> None:
    """Put the guard and the validation-error wrapper on a FastAPI ``app`` that has not started."""
    from fastapi.exceptions import RequestValidationError

    handler = app.exception_handlers.get(RequestValidationError)
    if handler is not None and not hasattr(handler, "__wrapped__"):
        app.exception_handlers[RequestValidationError] = wrap_validation_handler(handler)
    if not any(m.cls is BadInputGuard for m in app.user_middleware):
        app.add_middleware(BadInputGuard)


def install_on_launch(original, *args, **kwargs):
    """AROUND hook on SGLang's ``http_server.launch_server``: installs on its ``app`` first."""
    from sglang.srt.entrypoints import http_server

    install(http_server.app)
    return original(*args, **kwargs)
