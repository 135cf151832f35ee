"""server/errors.py and server/request_checks.py: bad input gets a readable 4xx without server paths,
shown on a small FastAPI app built like SGLang's (the e2e fuzz test covers SGLang's own app)."""

from __future__ import annotations

import json
import sys

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel, model_validator

from sgl_loopkv.server import errors
from sgl_loopkv.server.request_checks import (
    check_detokenize_request,
    check_input_ids,
    check_top_logprobs,
    normalize_embedding_request,
)


class Req(BaseModel):
    text: str
    n: int = 1

    @model_validator(mode="before")
    @classmethod
    def peek(cls, values):
        values.get("text")  # as SGLang's ChatCompletionRequest.set_json_schema: not every body is a dict
        return values


def make_app() -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def like_sglang(request, exc):  # SGLang's handler sends str(exc) as the message
        return JSONResponse({"object": "error", "message": f"{exc} {exc.errors()}", "code": 400}, status_code=400)

    @app.post("/req")
    async def req(r: Req):
        return {"text": r.text}

    @app.post("/value-error")
    async def value_error():
        raise ValueError(f"Cannot apply chat template in {sys.prefix}/lib/thing.py")

    @app.post("/server-fault")
    async def server_fault():
        raise RuntimeError("a real bug")

    @app.post("/stream/{kind}")
    async def stream(kind: str):
        async def gen():
            yield b"data: {}\n\n" if kind == "sse" else b"{}\n"
            raise ValueError("too many tokens")

        return StreamingResponse(gen(), media_type="text/event-stream" if kind == "sse" else "application/x-ndjson")

    @app.post("/v1/responses")
    async def responses(request_: dict):
        return {}

    return app


@pytest.fixture(params=[False, True], ids=["sglang-as-is", "guarded"])
def client(request):
    app = make_app()
    if request.param:
        errors.install(app)
        errors.install(app)  # idempotent
    with TestClient(app, raise_server_exceptions=False) as c:
        c.guarded = request.param
        yield c


def test_validation_errors_name_no_server_file_and_say_what_is_wrong(client):
    r = client.post("/req", json={"text": 3})
    assert r.status_code == 400
    msg = r.json()["message"]
    assert ("File " in msg and __file__ in msg) is not client.guarded  # FastAPI's endpoint context
    if client.guarded:
        assert msg.startswith("Invalid request. body.text: Input should be a valid string.")


def test_a_body_that_is_not_an_object_is_a_400_not_a_500(client):
    r = client.post("/req", json=[1, 2])
    assert r.status_code == (400 if client.guarded else 500)
    if client.guarded:
        assert r.json()["message"] == errors.NOT_AN_OBJECT


def test_value_errors_are_bad_input_and_other_exceptions_stay_500(client):
    r = client.post("/value-error")
    assert r.status_code == (400 if client.guarded else 500)
    if client.guarded:
        assert "Cannot apply chat template" in r.json()["message"] and sys.prefix not in r.text
    assert client.post("/server-fault").status_code == 500


@pytest.mark.parametrize("kind", ["sse", "ndjson"])
def test_a_stream_failing_on_bad_input_ends_with_an_error_record(client, kind):
    r = client.post(f"/stream/{kind}")
    assert r.status_code == 200
    if not client.guarded:  # the body is cut after the first record: the client never learns why
        assert "too many tokens" not in r.text
        return
    last = r.text.strip().splitlines()[-1]
    record = json.loads(last.removeprefix("data: "))
    assert "too many tokens" in json.dumps(record["error"])


def test_the_responses_api_answers_404_when_it_did_not_start(client):
    r = client.post("/v1/responses", json={})
    assert r.status_code == (404 if client.guarded else 200)
    client.app.state.openai_serving_responses = object()  # started: its routes are SGLang's again
    assert client.post("/v1/responses", json={}).status_code == 200


def test_scrub_replaces_server_paths_only():
    text = f"no file {sys.prefix}/lib/python3/site-packages/x.py here; see /v1/chat/completions"
    assert errors.scrub(text) == "no file <server path> here; see /v1/chat/completions"


def test_bad_input_message_classifies_by_exception():
    assert errors.bad_input_message(ValueError("bad n")) == "bad n"
    assert "unexpected keyword" in errors.bad_input_message(TypeError("f() got an unexpected keyword argument 'x'"))
    assert errors.bad_input_message(ExceptionGroup("g", [ValueError("inner")])) == "inner"
    assert errors.bad_input_message(TypeError("unsupported operand")) is None
    assert errors.bad_input_message(KeyError("state")) is None


def test_readable_errors():
    errs = [
        {"loc": ("body", 1), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}},
        {"loc": ("body", "messages", 0, "content"), "msg": "Input should be a valid string"},
    ]
    assert errors.readable_errors(errs) == (
        "Invalid request. body.1: JSON decode error (Expecting value); "
        "body.messages.0.content: Input should be a valid string."
    )


def test_top_logprobs_past_the_vocabulary_is_rejected():
    check_top_logprobs(True, 0, 100)
    check_top_logprobs(True, 100, 100)
    check_top_logprobs(False, 10**6, 100)  # not a logprob request: the value is never used
    for bad in (101, 10**6, -1):
        with pytest.raises(ValueError, match=r"\[0, 100\]"):
            check_top_logprobs(True, bad, 100)


def test_input_ids_outside_the_vocabulary_are_rejected():
    check_input_ids(None, 100)  # embeddings, not ids
    check_input_ids([0, 5, 99], 100)
    check_input_ids([], 100, allow_empty=True)
    with pytest.raises(ValueError, match="no tokens"):
        check_input_ids([], 100)
    for bad in ([100], [-1, 2], [1, 10**9], [1, "2"], [1.5]):
        with pytest.raises(ValueError, match=r"\[0, 100\)"):
            check_input_ids(bad, 100)


def test_detokenize_ids_outside_the_vocabulary_get_a_message():
    from types import SimpleNamespace

    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(model_config=SimpleNamespace(vocab_size=100)))
    ask = lambda tokens, result=None: check_detokenize_request(result, serving, SimpleNamespace(tokens=tokens))  # noqa: E731
    assert ask([1, 2]) is None and ask([[1], [2, 3]]) is None and ask([]) is None
    assert "[0, 100)" in ask([-1]) and "[0, 100)" in ask([[1], [2**40]])
    assert ask([-1], result="SGLang's own message") is None  # the AFTER hook keeps SGLang's answer


def test_embedding_batches_with_mismatched_lists_are_bad_input():
    from sgl_loopkv.platform import activate_cpu_standin, use_cpu_engine

    use_cpu_engine()
    activate_cpu_standin()
    from sglang.srt.managers.io_struct import EmbeddingReqInput

    def normalize(**fields):
        obj = EmbeddingReqInput(**fields)
        normalize_embedding_request(EmbeddingReqInput.normalize_batch_and_arguments, obj)
        return obj

    assert normalize(text=["a", "b"]).batch_size == 2
    for fields in ({"rid": []}, {"sampling_params": [{}]}, {"rid": "one"}):
        with pytest.raises(ValueError):
            normalize(text=["a", "b"], **fields)
        with pytest.raises((IndexError, AssertionError)):  # what SGLang does alone: a 500 or a crash later
            obj = EmbeddingReqInput(text=["a", "b"], **fields)
            obj.normalize_batch_and_arguments()
            [obj[i] for i in range(obj.batch_size)]
