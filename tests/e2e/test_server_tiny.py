"""The real SGLang server with sgl-loopkv on a tiny random-weight Llama: every API a user reaches,
bad input, the stand-in staying unused, an idle server staying idle, and equality with SGLang's
own torch_native attention."""

from __future__ import annotations

import json
import time

import psutil
import pytest
import requests

pytestmark = pytest.mark.server

LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(300))  # ~2.7K tokens


def generate(url, text=None, input_ids=None, **sampling):
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": 8, **sampling}}
    body.update({"text": text} if input_ids is None else {"input_ids": input_ids})
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_is_greedy_and_deterministic(tiny_server):
    a = generate(tiny_server.url, "The capital of France is", max_new_tokens=16, ignore_eos=True)
    b = generate(tiny_server.url, "The capital of France is", max_new_tokens=16, ignore_eos=True)
    assert len(a["output_ids"]) == 16 and a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["completion_tokens"] == 16 and isinstance(a["text"], str)


def test_openai_chat_with_official_client(tiny_server):
    import openai

    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length")


def test_frontend_program_runs_against_runtime_endpoint(tiny_server):
    import sglang as sgl

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", max_tokens=8, temperature=0)

    state = qa.run(question="What is 2+2?", backend=sgl.RuntimeEndpoint(tiny_server.url))
    assert isinstance(state["answer"], str)
    assert state.get_meta_info("answer")["completion_tokens"] > 0


def test_repeated_long_prompt_hits_the_radix_cache(tiny_server):
    first = generate(tiny_server.url, LONG_PROMPT + " Question one?", max_new_tokens=2)
    second = generate(tiny_server.url, LONG_PROMPT + " Question two?", max_new_tokens=2)
    assert first["meta_info"]["prompt_tokens"] > 2000
    assert second["meta_info"]["cached_tokens"] > 0.9 * first["meta_info"]["prompt_tokens"]


def test_streaming_generate_yields_chunks_then_done(tiny_server):
    body = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    with requests.post(f"{tiny_server.url}/generate", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        lines = [ln.decode() for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert len(chunks) >= 2  # incremental, not one final blob
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "path,payload,status,needle",
    [
        ("/generate", '{"text": "hi", broken', 400, "JSON"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
        ("/generate", {"text": "word " * 9000}, 400, "context length"),
        (
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "does not exist",
        ),
        ("/v1/chat/completions", {"model": "default", "messages": "not a list"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "context length",
        ),
    ],
)
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(tiny_server, path, payload, status, needle):
    data = payload if isinstance(payload, str) else json.dumps(payload)
    r = requests.post(tiny_server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == status, r.text
    assert needle.lower() in r.text.lower()
    assert generate(tiny_server.url, "still alive?", max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_no_standin_op_ran_while_serving(tiny_server, standin_trace):
    generate(tiny_server.url, "make sure at least one request ran", max_new_tokens=4)
    lines = standin_trace.read_text().splitlines()
    pids = {ln.split()[0] for ln in lines}
    assert len(pids) >= 2, "the stand-in must reach the scheduler and detokenizer subprocesses"
    assert not [ln for ln in lines if " call " in ln], lines


def test_idle_server_uses_almost_no_cpu(tiny_server):
    generate(tiny_server.url, "warm", max_new_tokens=1)
    time.sleep(2)  # let the scheduler go to sleep (--sleep-on-idle)
    procs = [psutil.Process(p) for p in tiny_server.pids()]
    before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    time.sleep(5)
    used = sum(p.cpu_times().user + p.cpu_times().system for p in procs) - before
    assert used / 5 < 0.10, f"idle server used {used / 5:.0%} of a core"


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    LONG_PROMPT[:3000],
    LONG_PROMPT * 2,  # ~5.4K tokens: prefilled in two chunks (chunked_prefill_size 4096), the 2nd with a prefix
]


def test_greedy_equal_to_sglang_torch_native(tiny_server, tiny_native_server):
    """Dense loopkv == SGLang's torch_native: fresh prompts, a cached-prefix turn, and logprobs."""
    for prompt in PROMPTS:
        for srv in (tiny_server, tiny_native_server):  # second round hits each server's radix cache
            generate(srv.url, prompt, max_new_tokens=1)
        ours = generate(tiny_server.url, prompt + " And then", max_new_tokens=24, ignore_eos=True)
        ref = generate(tiny_native_server.url, prompt + " And then", max_new_tokens=24, ignore_eos=True)
        if len(prompt) > 200:  # short prompts are shorter than one 16-token page: nothing to cache
            assert ours["meta_info"]["cached_tokens"] > 0
        assert ours["output_ids"] == ref["output_ids"], prompt[:40]


def test_logprobs_within_fp_tolerance_of_torch_native(tiny_server, tiny_native_server):
    body = {
        "text": LONG_PROMPT[:2000],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
    }
    a = requests.post(f"{tiny_server.url}/generate", json=body, timeout=300).json()["meta_info"]
    b = requests.post(f"{tiny_native_server.url}/generate", json=body, timeout=300).json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        xs = [t[0] for t in a[key] if t[0] is not None]
        ys = [t[0] for t in b[key] if t[0] is not None]
        assert len(xs) == len(ys) > 0
        assert max(abs(x - y) for x, y in zip(xs, ys)) < 1e-3
