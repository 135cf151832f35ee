"""The default model served from its GGUF blocks (``--loopkv-weights gguf``) serves what its converted float32
weights serve (the session's ``smollm2_server``): greedy tokens identical and logprobs within fp tolerance on
short prompts (the two compute the same weights; only the order of float32 sums differs), with the float
copies of its matrices gone from the scheduler's memory. One server, slow-marked (a second SmolLM2 start
is ~60-90 s on 2 cores); the default suite keeps ``tests/unit/test_gguf_weights.py``."""

from __future__ import annotations

import psutil
import pytest
import requests

from benchmarks.common import metrics
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n",
    "Photosynthesis is the process by which",
]
#: float32 bytes of the matrices served from blocks: 30 layers of q/k/v/o, gate/up/down and the tied
#: embedding (SmolLM2-135M: hidden 576, kv 192, MLP 1536, vocab 49152) - about 538 MB
FLOAT_BYTES = 4 * (30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536) + 49152 * 576)


@pytest.fixture(scope="module")
def gguf_server(default_model_dir, server_logs):
    args = ["--model-path", str(default_model_dir), *COMMON_SERVER_ARGS, "--loopkv-weights", "gguf", "--enable-metrics"]
    srv = ServerProcess(args, log_path=server_logs / "smollm2-gguf.log")
    with srv.start():
        yield srv


def greedy(url: str, prompt: str | list[int], n: int = 24) -> dict:
    """Greedy ids and their logprobs for a text or token-id prompt."""
    body = {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    r.raise_for_status()
    out = r.json()
    return {"ids": out["output_ids"], "logprobs": [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]}


def _scheduler_rss(srv: ServerProcess) -> int:
    return max(psutil.Process(p).memory_info().rss for p in srv.pids())


def test_gguf_blocks_serve_the_float32_tokens(gguf_server, smollm2_server):
    for prompt in PROMPTS:
        a, b = greedy(gguf_server.url, prompt), greedy(smollm2_server.url, prompt)
        assert a["ids"] == b["ids"], prompt
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 2e-3, prompt
    m = metrics(gguf_server.url)  # 30 blocks of qkv, o, gate+up, down, and the tied embedding
    assert m.get("loopkv_gguf_layers") == 121 and m.get("loopkv_lean_forward") == 1, m
    # the float copies are gone: at least half their bytes below the float32 server (same pool, same flags)
    assert _scheduler_rss(smollm2_server) - _scheduler_rss(gguf_server) > FLOAT_BYTES / 2
