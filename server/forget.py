"""``POST /loopkv/forget``: remove a conversation's stored KV from every tier (:mod:`sgl_loopkv.cache.forget`).

Body (JSON object; any other field is a 400)::

    {"messages": [...]}        a chat conversation, tokenized as /v1/chat/completions does
    {"prompt": "..."}          a /generate text prompt (the tokenizer's encode, as /generate)
    {"input_ids": [...]}       token ids
    {"cache_salt": "..."}      with one of the above: its namespace; alone: everything of that salt
    {"extra_key": "..."}       the request's extra_key (LoRA id ...), when it had one

Answers 200 with what was removed per tier, 404 when nothing stored matches, 409 while a running
request uses that KV, 400 for a bad body. Auth: SGLang's ``ADMIN_OPTIONAL`` level, the rule of
``/flush_cache``: with ``--admin-api-key`` only that key, else with ``--api-key`` that key, else open.

The HTTP process has no cache: the request goes to the scheduler over SGLang's control channel for
``/dumper`` (``DumperControlReqInput``: a method name and a JSON body), whose handler an AROUND hook
answers for our method (:func:`handle_control`) and passes on for any other.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Request  # the endpoint's annotation, resolved by FastAPI from this module

logger = logging.getLogger(__name__)

ROUTE = "/loopkv/forget"
METHOD = "loopkv.forget"
CONTROL_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_dumper_control"
FIELDS = {"messages": list, "prompt": str, "input_ids": list, "cache_salt": str, "extra_key": str}
SENTINEL = "\u2063loopkv-forget-probe\u2063"  # replaces the first own message: what differs is the conversation's own


def parse_body(body) -> dict:
    """The forget's fields, checked; raises ValueError with a message for the client."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; a forget takes {sorted(FIELDS)}")
    for name, kind in FIELDS.items():
        if name in body and body[name] is not None and not isinstance(body[name], kind):
            raise ValueError(f"{name} must be a {kind.__name__}")
    given = [k for k in ("messages", "prompt", "input_ids") if body.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"give one of messages, prompt, input_ids (got {given})")
    if not given and not body.get("cache_salt"):
        raise ValueError("give messages, prompt or input_ids (and/or cache_salt) to say what to forget")
    ids = body.get("input_ids")
    if ids is not None and not (ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ValueError("input_ids must be a non-empty list of token ids")
    if body.get("messages") is not None and not body["messages"]:
        raise ValueError("messages is empty")
    return {k: v for k, v in body.items() if v is not None}


def chat_tokens(serving_chat, messages: list, cache_salt: str | None) -> tuple[list[int], int]:
    """(the prompt ids /v1/chat/completions makes of ``messages``, where the conversation's own tokens
    start: the first token that changes when its first non-system message says something else)."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    def ids_of(msgs) -> list[int]:
        req = ChatCompletionRequest(model=serving_chat.tokenizer_manager.served_model_name, messages=msgs)
        out = serving_chat._process_messages(req, serving_chat.tokenizer_manager.model_config.is_multimodal)
        ids = out.prompt_ids
        return serving_chat.tokenizer_manager.tokenizer.encode(ids) if isinstance(ids, str) else list(ids)

    ids = ids_of(messages)
    own = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") not in ("system", "developer")),
        None,
    )
    if own is None:
        return ids, len(ids)
    probe = [dict(m) for m in messages]
    probe[own]["content"] = SENTINEL
    other = ids_of(probe)
    start = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
    return ids, start


async def forget_endpoint(request: Request):
    from fastapi.responses import ORJSONResponse
    from sglang.srt.managers.io_struct import DumperControlReqInput

    def answer(status: int, **content):
        return ORJSONResponse(content, status_code=status)

    try:
        spec = parse_body(await request.json())
    except ValueError as e:  # json.JSONDecodeError is one
        return answer(HTTPStatus.BAD_REQUEST, message=f"forget: {e}")
    serving_chat = request.app.state.openai_serving_chat
    tm = serving_chat.tokenizer_manager
    job = {"cache_salt": spec.get("cache_salt"), "extra_key": spec.get("extra_key")}
    try:
        if "messages" in spec:
            job["input_ids"], job["private_start"] = chat_tokens(serving_chat, spec["messages"], spec.get("cache_salt"))
        elif "prompt" in spec:
            job["input_ids"] = list(tm.tokenizer.encode(spec["prompt"]))
        elif "input_ids" in spec:
            job["input_ids"] = spec["input_ids"]
    except Exception as e:  # a malformed message list (pydantic), a template that refuses it
        return answer(HTTPStatus.BAD_REQUEST, message=f"forget: the messages cannot be tokenized: {e}")
    outs = await tm.dumper_control(DumperControlReqInput(method=METHOD, body=job))
    out = outs[0]
    if not out.success or not out.response:
        return answer(HTTPStatus.INTERNAL_SERVER_ERROR, message=f"forget failed: {out.error or 'no answer'}")
    result = dict(out.response[0])
    return answer(result.pop("status"), **result)


def install_route(app) -> None:
    """Add ``POST /loopkv/forget`` to SGLang's FastAPI ``app`` (before it starts), at /flush_cache's auth level."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return
    app.add_api_route(ROUTE, auth_level(AuthLevel.ADMIN_OPTIONAL)(forget_endpoint), methods=["POST"])


def handle_control(original, self, recv_req, *args, **kwargs):
    """AROUND hook on the scheduler's ``handle_dumper_control``: our method is answered here, on the
    scheduler thread between batches; any other goes to SGLang's dumper."""
    if getattr(recv_req, "method", None) != METHOD:
        return original(self, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    result = run(recv_req.body or {})
    self.ipc_channels.send_to_tokenizer.send_output(DumperControlReqOutput(success=True, response=[result]), recv_req)
    return None


def run(job: dict) -> dict:
    """The forget on this scheduler's cache -> {"status": HTTP status, ...}."""
    from sgl_loopkv.cache import forget
    from sgl_loopkv.context import get_context, has_context

    cache = get_context().cache if has_context() else None
    if cache is None or not hasattr(cache, "namespace_root"):
        return {"status": 400, "message": "forget needs the loopkv radix cache (--radix-cache-backend loopkv)"}
    try:
        report = forget.forget(
            cache,
            token_ids=job.get("input_ids"),
            private_start=job.get("private_start"),
            extra_key=job.get("extra_key"),
            salt=job.get("cache_salt"),
        )
    except forget.Busy as e:
        return {"status": 409, "message": str(e)}
    except ValueError as e:
        return {"status": 400, "message": f"forget: {e}"}
    except Exception as e:  # never the scheduler: it serves everyone
        logger.exception("loopkv: forget failed")
        return {"status": 500, "message": f"forget failed: {type(e).__name__}"}
    if report is None:
        return {
            "status": 404,
            "message": "nothing stored matches this conversation (already forgotten, or never stored)",
        }
    return {"status": 200, "removed": report.to_json(), "cluster_note": cache.store.disk is not None}
