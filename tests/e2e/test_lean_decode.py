"""Decode steps without SGLang's layer machinery (``sgl_loopkv/models/lean_decode.py``) compute
SGLang's numbers bitwise: the same server with ``LOOPKV_LEAN_DECODE=0`` is the reference. A change
in SGLang's Llama layers, norms or rotary embedding that breaks the equivalence fails here."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_loopkv.models.lean_decode import ENV
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS, _server
from tests.e2e.test_server_tiny import LONG_PROMPT

pytestmark = pytest.mark.server

ON = "lean decode steps: on"


def _decode(url: str, text: str, n: int = 24) -> dict:
    body = {
        "text": text,
        "return_logprob": True,
        "top_logprobs_num": 5,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    r.raise_for_status()
    out = r.json()
    m = out["meta_info"]
    return {"ids": out["output_ids"], "logprobs": m["output_token_logprobs"], "top": m["output_top_logprobs"]}


def _assert_bitwise_equal(lean: ServerProcess, reference: ServerProcess, prompts: list[str]) -> None:
    for prompt in prompts:
        for _ in range(2):  # the second round decodes after a cached prefix
            a, b = _decode(lean.url, prompt), _decode(reference.url, prompt)
            assert a == b, prompt[:40]
    assert ON in lean.log_path.read_text()
    assert ON not in reference.log_path.read_text()


@pytest.fixture(scope="module")
def tiny_reference_server(tiny_model_dir, server_logs):
    with _server(tiny_model_dir, server_logs, "tiny-lean-off", [], {ENV: "0"}).start() as srv:
        yield srv


def test_lean_decode_is_bitwise_sglangs_decode_step(tiny_server, tiny_reference_server):
    prompts = ["The capital of France is", "def fibonacci(n):", LONG_PROMPT[:3000]]
    _assert_bitwise_equal(tiny_server, tiny_reference_server, prompts)


def test_batched_lean_decode_matches_each_request_alone(tiny_server):
    """Several sequences in one decode batch (several rows through the rotary embedding and the
    attention backend): each request's logprobs as when it decodes alone, within fp tolerance (a linear
    layer of more rows may sum in another order)."""
    prompts = [f"Request {i}: {LONG_PROMPT[i * 300 : i * 300 + 600]}" for i in range(4)]
    alone = [_decode(tiny_server.url, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: _decode(tiny_server.url, p), prompts))
    for a, b in zip(alone, together):
        assert a["ids"] == b["ids"]
        assert max(abs(x[0] - y[0]) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-bf16", "smollm2"])
def test_lean_decode_is_bitwise_in_bf16_and_on_smollm2(model, tiny_model_dir, server_logs):
    if model == "smollm2":
        args = list(COMMON_SERVER_ARGS)
    else:
        args = ["--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[:-1], "bfloat16"]
    lean = ServerProcess(args, log_path=server_logs / f"{model}-lean-on.log")
    ref = ServerProcess(args, env={ENV: "0"}, log_path=server_logs / f"{model}-lean-off.log")
    with lean.start(), ref.start():
        _assert_bitwise_equal(lean, ref, ["Tell me about the ocean.", LONG_PROMPT[:2500]])
