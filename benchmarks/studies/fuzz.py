"""Fuzz sgl-loopkv's HTTP API from its own OpenAPI schema (schemathesis), plus hand-written bad input.

One server (the launcher's defaults, small caps so that generated requests stay cheap on a CPU); for
each user-facing operation schemathesis generates requests from the server's ``/openapi.json``, half
valid by the schema (positive) and half not (negative: wrong types, missing fields, odd strings, bodies
that are not JSON). Hand-written cases cover what a schema does not: invalid UTF-8, a prompt past the
context, huge ``max_tokens`` and ``n``, absurd sampling values, hostile names. Every response is
classified:

- ``server_errors``: HTTP 5xx, or a 5xx error object inside a 200 event stream (the acceptance is 0);
- ``path_leaks``: an error body naming a file path of the server, or any body carrying a Python
  traceback (info endpoints such as ``/server_info`` name the model path by design: not counted);
- ``unreadable_errors``: a 4xx whose body is not JSON with a message;
- ``crashed``: ``/health`` not 200 after an operation's cases, or after the run.

Writes ``benchmarks/results/fuzz.{json,md}`` (``summary.cases``, ``summary.server_errors``).

    python -m benchmarks.studies.fuzz                  # >= 500 generated cases + the hand-written ones
    python -m benchmarks.studies.fuzz --examples 6     # per operation and mode (quick)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.studies import RESULTS, write_results
from sgl_loopkv.server.process import ServerProcess

#: User-facing operations: the OpenAI, Anthropic, Ollama, SageMaker and Vertex adapters, SGLang's
#: native generation API and its read-only info endpoints. Admin ones (weight updates, profiling,
#: cache flush, pause, LoRA loading, logging) are left out: a deployment puts them behind
#: ``--admin-api-key``, and fuzzing them would change the server under test.
OPERATIONS = [
    ("POST", "/generate"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/show"),
    ("GET", "/api/tags"),
    ("POST", "/invocations"),
    ("POST", "/vertex_generate"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/classify"),
    ("POST", "/v1/score"),
    ("POST", "/v1/rerank"),
    ("POST", "/encode"),
    ("POST", "/classify"),
    ("POST", "/v1/tokenize"),
    ("POST", "/v1/detokenize"),
    ("POST", "/separate_reasoning"),
    ("POST", "/parse_function_call"),
    ("POST", "/open_session"),
    ("POST", "/close_session"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/v1/loads"),
    ("GET", "/model_info"),
    ("GET", "/server_info"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("GET", "/ready"),
    ("GET", "/ping"),
    ("GET", "/"),
]
#: What the CI test fuzzes: the generation endpoints and three cheap ones. An operation may name its
#: generation modes: schemathesis' negative mode first derives mutation targets from the body schema,
#: a walk that takes a minute or more on 2 cores for SGLang's chat and completion request models (once
#: per operation); the hand-written cases cover their invalid input there, the benchmark runs both modes.
CORE_OPERATIONS = [
    ("POST", "/generate"),
    ("POST", "/v1/chat/completions", ("positive",)),
    ("POST", "/v1/completions", ("positive",)),
    ("POST", "/v1/tokenize"),
    ("POST", "/v1/detokenize"),
    ("GET", "/v1/models/{model}"),
]
#: Caps the server is started with: generated requests stay cheap, and over-limit ones must get a 4xx.
SERVER_ARGS = ["--max-total-tokens", "2048", "--context-length", "1024", "--loopkv-limit-max-n", "2"]
#: Generation lengths a generated body may ask for are clamped to this; asking for 10**12 tokens is
#: a hand-written case of its own.
MAX_GEN = 4
#: Fields that set how many tokens or sequences a request generates (every adapter's spelling).
LENGTH_KEYS = frozenset(
    {"max_tokens", "max_completion_tokens", "max_new_tokens", "max_output_tokens", "num_predict", "min_tokens"}
    | {"min_new_tokens", "maxOutputTokens"}
)
FANOUT_KEYS = frozenset({"n", "best_of", "num_return_sequences"})
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+")


def clamp_body(body):
    """Bound every generation-length and fan-out field of a generated body, at any depth (in place;
    returns ``body``). Negative and non-integer values are left for the server to reject."""
    if isinstance(body, dict):
        for key, value in body.items():
            if type(value) is int and key in LENGTH_KEYS and value > MAX_GEN:
                body[key] = MAX_GEN
            elif type(value) is int and key in FANOUT_KEYS and value > 2:
                body[key] = 2
            else:
                clamp_body(value)
    elif isinstance(body, list):
        for item in body:
            clamp_body(item)
    return body


def server_paths() -> list[str]:
    """Absolute paths of this machine that name the server's files (the client and the server share
    the machine): the Python environment, the checkout, the home directory (the model cache)."""
    import sglang

    paths = {sys.prefix, str(Path(sglang.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1])}
    paths.add(str(Path.home()))
    return sorted((p for p in paths if len(p) > 1), key=len, reverse=True)


def find_leak(body: str, request: str, is_error: bool, paths: list[str]) -> str | None:
    """What in ``body`` reveals the server's internals, or None: a traceback anywhere; in an error
    body also a server path. A path the request itself contained (an echo) is not a leak."""
    m = TRACEBACK.search(body)
    if m:
        return m.group(0)
    if is_error:
        for p in paths:
            for hit in re.finditer(re.escape(p) + r"(?:/[\w.+-]+)*", body):
                if hit.group(0) not in request:
                    return hit.group(0)
    return None


def error_message(body: str) -> str | None:
    """The human-readable message of an error body (SGLang's, OpenAI's, Anthropic's and FastAPI's
    shapes), or None where there is none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    for candidate in (obj.get("message"), obj.get("error"), obj.get("detail")):
        if isinstance(candidate, dict):
            candidate = candidate.get("message")
        if isinstance(candidate, list) and candidate:  # FastAPI's detail list
            candidate = candidate[0].get("msg") if isinstance(candidate[0], dict) else None
        if isinstance(candidate, str) and candidate.strip():
            return candidate
    return None


def stream_server_error(body: str) -> int | None:
    """The status of a 5xx error object sent inside an event stream (a 200 response), or None."""
    for line in body.splitlines():
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        try:
            obj = json.loads(line[5:])
        except ValueError:
            continue
        err = obj.get("error") if isinstance(obj, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        if isinstance(code, int) and code >= 500:
            return code
    return None


@dataclass
class Tally:
    """Every response of a run, classified (see the module docstring)."""

    paths: list[str] = field(default_factory=server_paths)
    status: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    server_errors: list[dict] = field(default_factory=list)
    leaks: list[dict] = field(default_factory=list)
    unreadable: list[dict] = field(default_factory=list)
    transport_errors: list[dict] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # cases schemathesis could not send
    cases: int = 0

    def record(self, op: str, status: int | None, body: str, request: str, content_type: str = "") -> None:
        self.cases += 1
        sample = {"op": op, "status": status, "request": request[:400], "body": body[:400]}
        if status is None:
            self.transport_errors.append(sample)
            self.status[op]["no response"] += 1
            return
        self.status[op][str(status)] += 1
        streamed = "text/event-stream" in content_type
        in_stream = stream_server_error(body) if streamed else None
        if status >= 500 or in_stream:
            self.server_errors.append({**sample, "in_stream": in_stream})
        leak = find_leak(body, request, status >= 400 or streamed, self.paths)
        if leak:
            self.leaks.append({**sample, "match": leak})
        if 400 <= status < 500 and error_message(body) is None:
            self.unreadable.append(sample)

    def summary(self) -> dict:
        return {
            "cases": self.cases,
            "server_errors": len(self.server_errors),
            "path_leaks": len(self.leaks),
            "unreadable_errors": len(self.unreadable),
            "transport_errors": len(self.transport_errors),
            "crashes": len(self.crashes),
            "skipped_unsendable": sum(self.skipped.values()),
        }


def healthy(url: str, wait_s: float = 60) -> bool:
    """``/health`` answers 200 within ``wait_s`` (it answers 503 while SGLang still warms up after
    start, and takes a second or more while the scheduler is busy)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if requests.get(f"{url}/health", timeout=60).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(2)


def _fuzz_operation(strategy, name: str, url: str, session, tally: Tally, examples: int, seed: int):
    """A Hypothesis test that sends ``examples`` cases drawn from ``strategy`` and records each response."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    @hypothesis.seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=hypothesis.Verbosity.quiet,
    )
    @given(case=strategy)
    def run(case):
        if case.body is not None and not isinstance(case.body, bytes):
            case.body = clamp_body(case.body)
        request = f"{case.method} {case.formatted_path} query={case.query!r} body={case.body!r}"
        try:
            r = case.call(base_url=url, session=session, timeout=120)
        except requests.RequestException as e:
            tally.record(name, None, repr(e), request)
            return
        except Exception as e:  # noqa: BLE001 - schemathesis could not serialize or send the case
            tally.skipped[f"{name}: {type(e).__name__}: {str(e)[:120]}"] += 1
            return
        tally.record(name, r.status_code, r.text, request, r.headers.get("content-type", ""))

    return run


def fuzz_schema(url: str, tally: Tally, examples: int, operations=OPERATIONS, seed: int = 0, progress=True) -> int:
    """Up to ``examples`` positive and ``examples`` negative generated cases per operation ``(method,
    path)``, or only the modes an operation names (``(method, path, ("positive",))``); fewer where the
    schema has fewer distinct ones (a GET without parameters has one). Returns how many were sent. A
    failed ``/health`` after an operation's cases is recorded as a crash."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    before = tally.cases
    session = requests.Session()
    jobs = [
        ((method, path), GenerationMode(mode))
        for method, path, *modes in operations
        for mode in (modes[0] if modes else ("positive", "negative"))
    ]
    for (method, path), mode in tqdm(jobs, desc="fuzz: schema", disable=not progress):
        name = f"{method} {path}"
        try:
            op = schema[path][method.lower()]
        except KeyError:
            tally.skipped[f"{name}: not in the schema"] += 1
            continue

        run = _fuzz_operation(op.as_strategy(generation_mode=mode), name, url, session, tally, examples, seed)
        try:
            run()
        except Exception as e:  # noqa: BLE001 - e.g. no negative case exists for an operation without input
            tally.skipped[f"{name} ({mode.value}): {type(e).__name__}: {str(e)[:120]}"] += 1
        if not healthy(url):
            tally.crashes.append(name)
    return tally.cases - before


@dataclass(frozen=True, slots=True)
class HandCase:
    name: str
    method: str
    path: str
    kwargs: dict  # for requests.request
    expect_4xx: bool = True  # bad input: the answer must be a 4xx, not merely "not 5xx"


def hand_written_cases() -> list[HandCase]:
    """Bad input a schema does not generate, or generates too rarely to count on."""
    chat, gen, comp = "/v1/chat/completions", "/generate", "/v1/completions"
    msg = [{"role": "user", "content": "hi"}]
    raw = {"Content-Type": "application/json"}
    past_context = "word " * 3000  # the server's --context-length is 1024
    cases = [
        HandCase("body not JSON", "POST", chat, {"data": b"{not json", "headers": raw}),
        HandCase(
            "invalid UTF-8",
            "POST",
            chat,
            {"data": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "headers": raw},
        ),
        HandCase("empty body", "POST", chat, {"data": b"", "headers": raw}),
        HandCase("body a JSON list", "POST", chat, {"json": [1, 2]}),
        HandCase("wrong content type", "POST", chat, {"data": b"hello", "headers": {"Content-Type": "text/plain"}}),
        HandCase("empty messages", "POST", chat, {"json": {"messages": []}}),
        HandCase("messages wrong type", "POST", chat, {"json": {"messages": "hello"}}),
        HandCase("content wrong type", "POST", chat, {"json": {"messages": [{"role": "user", "content": 12}]}}),
        HandCase("unknown role", "POST", chat, {"json": {"messages": [{"role": "wizard", "content": "hi"}]}}),
        HandCase("huge max_tokens", "POST", chat, {"json": {"messages": msg, "max_tokens": 10**12}}),
        HandCase("max_tokens past 2^63", "POST", chat, {"json": {"messages": msg, "max_tokens": 2**70}}),
        HandCase("negative max_tokens", "POST", chat, {"json": {"messages": msg, "max_tokens": -5}}),
        HandCase("max_tokens a string", "POST", chat, {"json": {"messages": msg, "max_tokens": "many"}}),
        HandCase("n over the limit", "POST", chat, {"json": {"messages": msg, "n": 1000}}),
        HandCase("n zero", "POST", chat, {"json": {"messages": msg, "n": 0, "max_tokens": 2}}),
        HandCase(
            "temperature 1e30",
            "POST",
            chat,
            {"json": {"messages": msg, "temperature": 1e30, "max_tokens": 2}},
            expect_4xx=False,
        ),
        HandCase("temperature negative", "POST", chat, {"json": {"messages": msg, "temperature": -3, "max_tokens": 2}}),
        HandCase("top_p 7", "POST", chat, {"json": {"messages": msg, "top_p": 7, "max_tokens": 2}}),
        HandCase("top_k -100", "POST", chat, {"json": {"messages": msg, "top_k": -100, "max_tokens": 2}}),
        HandCase(
            "frequency_penalty 1e9",
            "POST",
            chat,
            {"json": {"messages": msg, "frequency_penalty": 1e9, "max_tokens": 2}},
        ),
        HandCase(
            "top_logprobs 10^6",
            "POST",
            chat,
            {"json": {"messages": msg, "logprobs": True, "top_logprobs": 10**6, "max_tokens": 2}},
        ),
        HandCase(
            "logit_bias bad token",
            "POST",
            chat,
            {"json": {"messages": msg, "logit_bias": {"999999999": 5}, "max_tokens": 2}},
        ),
        HandCase(
            "stop list of 10^4",
            "POST",
            chat,
            {"json": {"messages": msg, "stop": ["x"] * 10**4, "max_tokens": 2}},
            expect_4xx=False,
        ),
        HandCase(
            "prompt past the context", "POST", chat, {"json": {"messages": [{"role": "user", "content": past_context}]}}
        ),
        HandCase("unknown model name", "POST", chat, {"json": {"model": "../../etc/passwd", "messages": msg}}),
        HandCase(
            "NaN in JSON",
            "POST",
            gen,
            {"data": b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "headers": raw},
        ),
        HandCase(
            "NaN temperature",
            "POST",
            gen,
            {"data": b'{"text": "hi", "sampling_params": {"temperature": NaN, "max_new_tokens": 2}}', "headers": raw},
        ),
        HandCase(
            "Infinity top_p",
            "POST",
            gen,
            {"data": b'{"text": "hi", "sampling_params": {"top_p": Infinity, "max_new_tokens": 2}}', "headers": raw},
        ),
        HandCase(
            "huge max_new_tokens", "POST", gen, {"json": {"text": "hi", "sampling_params": {"max_new_tokens": 10**12}}}
        ),
        HandCase(
            "prompt past the context",
            "POST",
            gen,
            {"json": {"text": past_context, "sampling_params": {"max_new_tokens": 2}}},
        ),
        HandCase(
            "input_ids past the context",
            "POST",
            gen,
            {"json": {"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 2}}},
        ),
        HandCase(
            "input_ids out of vocab",
            "POST",
            gen,
            {"json": {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}}},
        ),
        HandCase(
            "input_ids negative",
            "POST",
            gen,
            {"json": {"input_ids": [-1, 2], "sampling_params": {"max_new_tokens": 2}}},
        ),
        HandCase("input_ids empty", "POST", gen, {"json": {"input_ids": [], "sampling_params": {"max_new_tokens": 2}}}),
        HandCase(
            "text empty",
            "POST",
            gen,
            {"json": {"text": "", "sampling_params": {"max_new_tokens": 2}}},
        ),
        # SGLang answers from the text and ignores the ids: accepted, as long as it is not a 5xx
        HandCase("both text and ids", "POST", gen, {"json": {"text": "hi", "input_ids": [1, 2]}}, expect_4xx=False),
        HandCase("neither text nor ids", "POST", gen, {"json": {"sampling_params": {"max_new_tokens": 2}}}),
        HandCase(
            "batch of mixed types", "POST", gen, {"json": {"text": ["hi", 3], "sampling_params": {"max_new_tokens": 2}}}
        ),
        HandCase("sampling_params wrong type", "POST", gen, {"json": {"text": "hi", "sampling_params": "greedy"}}),
        HandCase(
            "n over the limit", "POST", gen, {"json": {"text": "hi", "sampling_params": {"n": 64, "max_new_tokens": 2}}}
        ),
        HandCase(
            "top_logprobs_num 10^6",
            "POST",
            gen,
            {
                "json": {
                    "text": "hi",
                    "return_logprob": True,
                    "top_logprobs_num": 10**6,
                    "sampling_params": {"max_new_tokens": 2},
                }
            },
        ),
        HandCase(
            "logprob_start_len past the prompt",
            "POST",
            gen,
            {
                "json": {
                    "text": "hi",
                    "return_logprob": True,
                    "logprob_start_len": 10**6,
                    "sampling_params": {"max_new_tokens": 2},
                }
            },
        ),
        HandCase(
            "hostile rid",
            "POST",
            gen,
            {"json": {"text": "hi", "rid": "../../etc/passwd", "sampling_params": {"max_new_tokens": 2}}},
            expect_4xx=False,
        ),
        HandCase(
            "hostile extra_key",
            "POST",
            gen,
            {"json": {"text": "hi", "extra_key": "../../../tmp/x", "sampling_params": {"max_new_tokens": 2}}},
            expect_4xx=False,
        ),
        HandCase(
            "regex that does not compile",
            "POST",
            gen,
            {"json": {"text": "hi", "sampling_params": {"regex": "(((", "max_new_tokens": 2}}},
        ),
        HandCase(
            "json_schema not a schema",
            "POST",
            gen,
            {"json": {"text": "hi", "sampling_params": {"json_schema": "{nope", "max_new_tokens": 2}}},
        ),
        HandCase("prompt list of ints past vocab", "POST", comp, {"json": {"prompt": [10**9], "max_tokens": 2}}),
        HandCase("empty prompt", "POST", comp, {"json": {"prompt": "", "max_tokens": 2}}),
        HandCase("prompt past the context", "POST", comp, {"json": {"prompt": past_context, "max_tokens": 2}}),
        HandCase(
            "echo with logprobs 10^6",
            "POST",
            comp,
            {"json": {"prompt": "hi", "echo": True, "logprobs": 10**6, "max_tokens": 2}},
        ),
        HandCase("detokenize garbage", "POST", "/v1/detokenize", {"json": {"tokens": ["x", None]}}),
        HandCase("batch with an empty rid list", "POST", "/v1/classify", {"json": {"input": ["a", "b"], "rid": []}}),
        HandCase(
            "batch, sampling_params too short",
            "POST",
            "/encode",
            {"json": {"text": ["a", "b"], "sampling_params": [{}]}},
        ),
        HandCase(
            "batch with an empty rid list",
            "POST",
            gen,
            {"json": {"text": ["a", "b"], "rid": [], "sampling_params": {"max_new_tokens": 2}}},
        ),
        HandCase("detokenize past vocab", "POST", "/v1/detokenize", {"json": {"tokens": [10**9]}}),
        HandCase("detokenize negative id", "POST", "/v1/detokenize", {"json": {"tokens": [-1]}}),
        HandCase("tokenize wrong type", "POST", "/v1/tokenize", {"json": {"prompt": {"a": 1}}}),
        HandCase(
            "anthropic max_tokens huge",
            "POST",
            "/v1/messages",
            {"json": {"model": "default", "max_tokens": 10**12, "messages": msg}},
        ),
        HandCase(
            "ollama num_predict huge",
            "POST",
            "/api/generate",
            {"json": {"model": "default", "prompt": "hi", "stream": False, "options": {"num_predict": 10**12}}},
        ),
        HandCase("unknown path", "GET", "/../../etc/passwd", {}),
        HandCase("wrong method", "DELETE", chat, {}),
    ]
    return cases


def run_hand_written(url: str, tally: Tally, progress=True) -> list[dict]:
    """Send every hand-written case; returns one row per case (``ok``: the status is what the case
    expects: a 4xx for bad input, otherwise anything below 500)."""
    rows = []
    for c in tqdm(hand_written_cases(), desc="fuzz: hand-written", disable=not progress):
        name = f"hand: {c.method} {c.path}: {c.name}"
        request = f"{c.method} {c.path} {c.kwargs.get('json', c.kwargs.get('data'))!r}"
        try:
            r = requests.request(c.method, f"{url}{c.path}", timeout=300, **c.kwargs)
            status, body, ctype = r.status_code, r.text, r.headers.get("content-type", "")
        except requests.RequestException as e:
            status, body, ctype = None, repr(e), ""
        tally.record(name, status, body, request, ctype)
        ok = status is not None and (400 <= status < 500 if c.expect_4xx else status < 500)
        rows.append(
            {
                "case": c.name,
                "method": c.method,
                "path": c.path,
                "status": status,
                "ok": ok,
                "message": (error_message(body) or body)[:300],
            }
        )
    return rows


def fuzz(url: str, examples: int, operations=OPERATIONS, seed: int = 0, progress=True) -> dict:
    """The whole run against a server at ``url``: generated cases, hand-written cases, a final
    liveness check (``/health`` and a short ``/generate``). Returns the results payload."""
    t0 = time.perf_counter()
    tally = Tally()
    generated = fuzz_schema(url, tally, examples, operations, seed, progress)
    hand = run_hand_written(url, tally, progress)
    alive = healthy(url)
    try:
        gen_after = requests.post(
            f"{url}/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}, timeout=120
        ).status_code
    except requests.RequestException:
        gen_after = None
    if not alive:
        tally.crashes.append("end of run")
    summary = {
        **tally.summary(),
        "generated_cases": generated,
        "hand_written_cases": len(hand),
        "hand_written_unexpected": sum(not r["ok"] for r in hand),
        "health_after": alive,
        "generate_after": gen_after,
        "duration_s": time.perf_counter() - t0,
    }
    return {
        "summary": summary,
        "status_by_operation": {k: dict(v) for k, v in sorted(tally.status.items())},
        "server_error_samples": tally.server_errors[:50],
        "path_leak_samples": tally.leaks[:50],
        "unreadable_error_samples": tally.unreadable[:50],
        "transport_error_samples": tally.transport_errors[:20],
        "crashes": tally.crashes,
        "skipped": dict(tally.skipped),
        "hand_written": hand,
    }


def markdown(payload: dict, command: str) -> str:
    s = payload["summary"]
    ops = {k: v for k, v in payload["status_by_operation"].items() if not k.startswith("hand: ")}
    ratio = lambda n: f"{n} ({n / max(s['cases'], 1):.1%})"  # noqa: E731
    lines = [
        f"# fuzz ({payload['env']['when']}; `{command}`)\n",
        f"{s['cases']} requests: {s['generated_cases']} generated by schemathesis from the server's `/openapi.json` "
        f"over {len(ops)} user-facing operations, {s['hand_written_cases']} hand-written.\n",
        md_table(
            [
                "server errors (5xx)",
                "path / traceback leaks",
                "4xx without a message",
                "no response",
                "crashes",
                "`/health` after",
            ],
            [
                [
                    ratio(s["server_errors"]),
                    ratio(s["path_leaks"]),
                    ratio(s["unreadable_errors"]),
                    s["transport_errors"],
                    s["crashes"],
                    "200" if s["health_after"] else "not 200",
                ]
            ],
        ),
        "\nGenerated cases by operation and status:\n",
        md_table(
            ["operation", "responses by status"],
            [[op, ", ".join(f"{k}: {n}" for k, n in sorted(c.items()))] for op, c in ops.items()],
        ),
        f"\nHand-written cases ({s['hand_written_unexpected']} not answered as expected: bad input must get a 4xx):\n",
        md_table(
            ["case", "endpoint", "status", "message (first 120 chars)"],
            [
                [
                    r["case"],
                    f"{r['method']} {r['path']}",
                    r["status"],
                    r["message"][:120].replace("|", "\\|").replace("\n", " "),
                ]
                for r in payload["hand_written"]
            ],
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=12, help="generated cases per operation and mode (default 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-path", default=None, help="default: the launcher's embedded default model")
    args = ap.parse_args()

    server_args = [*SERVER_ARGS, *(["--model-path", args.model_path] if args.model_path else [])]
    with ServerProcess(server_args, log_path=RESULTS / "fuzz.log") as srv:
        payload = fuzz(srv.url, args.examples, seed=args.seed)
    payload.update(server_args=server_args, examples_per_operation_and_mode=args.examples, env=environment())
    command = "python -m benchmarks.studies.fuzz" + (f" --examples {args.examples}" if args.examples != 12 else "")
    write_results("fuzz", payload, markdown(payload, command))
    print(json.dumps(payload["summary"], indent=2))
    for e in payload["server_error_samples"][:10] + payload["path_leak_samples"][:10]:
        print(e)


if __name__ == "__main__":
    main()
