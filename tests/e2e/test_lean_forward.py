"""Forwards without SGLang's layer machinery (``sgl_loopkv/models/lean_forward.py``) compute SGLang's
numbers bitwise, prefill and decode: the same server with ``LOOPKV_LEAN_FORWARD=0`` is the reference. A change
in SGLang's Llama layers, norms or rotary embedding that breaks the equivalence fails here.

The bitwise pairs are slow-marked (two more servers each; the default suite stays under 15 minutes).
The default suite holds the lean tiny server to SGLang's own forward and attention within fp tolerance
(``test_server_tiny.py``: greedy identical, logprobs within 1e-3; ``tiny_native_server`` runs with the
lean forward off) and pins the SGLang sources it mirrors (``tests/unit/test_sglang_privates.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from benchmarks.common import metrics
from sgl_loopkv.models.lean_forward import ENV
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS, _server
from tests.e2e.test_server_tiny import LONG_PROMPT

pytestmark = pytest.mark.server

ON = "loopkv_lean_forward"  # 1 where the lean forward runs the batches (absent with LOOPKV_LEAN_FORWARD=0)


def _decode(url: str, text: str, n: int = 24, prompt_logprobs: bool = False) -> dict:
    """Greedy tokens and logprobs; ``prompt_logprobs``: every prompt position's too (a prefill of every
    row: SGLang then reuses no cached prefix)."""
    body = {
        "text": text,
        "return_logprob": True,
        "top_logprobs_num": 5,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    if prompt_logprobs:
        body["logprob_start_len"] = 0
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    r.raise_for_status()
    out = r.json()
    m = out["meta_info"]
    keys = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
    return {"ids": out["output_ids"], **{k: m.get(k) for k in keys}}


def _assert_bitwise_equal(lean: ServerProcess, reference: ServerProcess, prompts: list[str]) -> None:
    for prompt in prompts:
        for prompt_logprobs in (False, False, True):  # the second round prefills after a cached prefix
            a, b = (_decode(srv.url, prompt, prompt_logprobs=prompt_logprobs) for srv in (lean, reference))
            assert a == b, prompt[:40]
    assert metrics(lean.url).get(ON) == 1
    assert metrics(lean.url).get("loopkv_layer_ops") == 0  # float weights keep SGLang's torch ops, bitwise
    assert metrics(reference.url).get(ON, 0) == 0


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir, server_logs):
    """Two fresh servers, lean forward on and off, that will serve the same requests in the same order:
    equal radix trees and pool layouts (the session's tiny server has served other tests, and an extend
    over a fragmented history takes another, equally exact, attention path)."""
    lean = _server(tiny_model_dir, server_logs, "tiny-lean-on", ["--enable-metrics"])
    ref = _server(tiny_model_dir, server_logs, "tiny-lean-off", ["--enable-metrics"], {ENV: "0"})
    with lean.spawn(), ref.spawn():  # both start-ups at once: the suite's time
        lean.wait_ready(600)
        ref.wait_ready(600)
        yield lean, ref


@pytest.mark.slow
def test_lean_forward_is_bitwise_sglangs_prefill_and_decode(tiny_pair):
    _assert_bitwise_equal(*tiny_pair, ["The capital of France is", "def fibonacci(n):", LONG_PROMPT[:3000]])


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
        pairs = zip(a["output_token_logprobs"], b["output_token_logprobs"])
        assert max(abs(x[0] - y[0]) for x, y in pairs) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-bf16", "smollm2"])
def test_lean_forward_is_bitwise_in_bf16_and_on_smollm2(model, tiny_model_dir, server_logs):
    if model == "smollm2":  # the float32 conversion: the GGUF path's compiled layer ops are not bitwise
        args = [*COMMON_SERVER_ARGS, "--loopkv-weights", "float32"]
    else:
        args = ["--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[:-1], "bfloat16"]
    args.append("--enable-metrics")
    lean = ServerProcess(args, log_path=server_logs / f"{model}-lean-on.log")
    ref = ServerProcess(args, env={ENV: "0"}, log_path=server_logs / f"{model}-lean-off.log")
    with lean.spawn(), ref.spawn():
        lean.wait_ready(600)
        ref.wait_ready(600)
        _assert_bitwise_equal(lean, ref, ["Tell me about the ocean.", LONG_PROMPT[:2500]])
