"""``--model-path x.gguf`` on the CPU: the default model's GGUF file served through SGLang's GGUF path with
the block kernels serves what its converted float32 weights serve (the session's ``smollm2_server``):
greedy tokens identical and logprobs within fp tolerance (the same weights; only the order of float32
sums and the element-wise ops' roundings differ), the same chat template (from the file's metadata), no float copy of a matrix kept."""

from __future__ import annotations

import psutil
import pytest
import requests

from benchmarks.common import metrics
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS
from tests.e2e.test_gguf_weights import FLOAT_BYTES, PROMPTS, greedy

pytestmark = pytest.mark.server


def _chat(url: str, model: str, text: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 0}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_gguf_file_serves_what_its_float32_conversion_serves(gguf_file_server, smollm2_server):
    from transformers import AutoTokenizer

    from sgl_loopkv.config import default_cache_dir
    from sgl_loopkv.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model(default_cache_dir()))
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        a, b = greedy(gguf_file_server.url, ids), greedy(smollm2_server.url, ids)
        assert a["ids"] == b["ids"], prompt
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 2e-3, prompt
    m = metrics(gguf_file_server.url)  # 30 blocks of qkv, o, gate+up, down, and the tied embedding
    assert m.get("loopkv_gguf_layers") == 121 and m.get("loopkv_lean_forward") == 1, m
    assert m.get("loopkv_layer_ops") == 1, m  # the compiled norm, rotary and activation ops


@pytest.fixture(scope="module")
def gguf_default_server(server_logs):
    """A plain start (no --model-path, no --loopkv-weights): the default model's GGUF file from its blocks
    over a bfloat16 KV pool. For this module only and with a small pool: one more SmolLM2 server beside
    the session's shared ones ran a 24 GB machine out of memory."""
    args = [*COMMON_SERVER_ARGS[2:], "--max-total-tokens", "2048", "--enable-metrics"]
    srv = ServerProcess(args, log_path=server_logs / "gguf-default.log")
    with srv.start():
        yield srv


def test_a_plain_start_serves_the_default_models_gguf_blocks(gguf_default_server):
    info = requests.get(f"{gguf_default_server.url}/get_server_info", timeout=30).json()
    assert info["model_path"].endswith(".gguf") and info["kv_cache_dtype"] == "bf16", info
    models = requests.get(f"{gguf_default_server.url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"  # the default model's name, not the file's stem
    greedy(gguf_default_server.url, PROMPTS[0], n=2)  # the layer ops' gauge is set at the first forward
    m = metrics(gguf_default_server.url)
    assert m.get("loopkv_gguf_layers") == 121 and m.get("loopkv_layer_ops") == 1, m


def test_the_default_bf16_pool_keeps_the_float32_models_next_tokens(gguf_default_server, smollm2_server):
    """A GGUF start keeps its KV in bfloat16 by default: no longer the float32 model's bits, but its
    next-token distribution at every position of the float32 model's own greedy answers stays within
    the fidelity bar, through both paths: one long extend (the prefill path) and one short extend per
    position (the decode-step path). The benchmark holds 0.99 over 384 positions per context
    (docs/models.md); these 72 positions of a weak model that flips near-ties allow one flip."""
    from transformers import AutoTokenizer

    from benchmarks.common import teacher_forced_steps, teacher_forced_top1
    from benchmarks.restore import kl_topk
    from sgl_loopkv.config import default_cache_dir
    from sgl_loopkv.models import ensure_default_model

    info = requests.get(f"{gguf_default_server.url}/get_server_info", timeout=30).json()
    assert info["kv_cache_dtype"] == "bf16", info.get("kv_cache_dtype")
    tok = AutoTokenizer.from_pretrained(ensure_default_model(default_cache_dir()))
    agree, long_agree, kls = [], [], []
    for prompt in PROMPTS[:3]:
        ids = tok(prompt)["input_ids"]
        answer = greedy(smollm2_server.url, ids)["ids"]
        long_agree += [a == b for a, b in zip(teacher_forced_top1(gguf_default_server.url, ids, answer), answer)]
        ref = teacher_forced_steps(smollm2_server.url, ids, answer)
        ours = teacher_forced_steps(gguf_default_server.url, ids, answer, ref)
        agree += [max(o["top"], key=o["top"].get) == t for o, t in zip(ours, answer)]
        kls += [kl_topk(r["top"], {**o["top"], **o["chosen"]}) for r, o in zip(ref, ours)]
    assert sum(agree) >= len(agree) - 1 and sum(long_agree) >= len(long_agree) - 1, (agree, long_agree)
    assert sum(kls) / len(kls) <= 0.01, kls


def test_the_chat_template_and_model_name_come_from_the_file(gguf_file_server, smollm2_server):
    models = requests.get(f"{gguf_file_server.url}/v1/models", timeout=30).json()
    name = models["data"][0]["id"]
    assert name == "SmolLM2-135M-Instruct.Q4_1"  # the file's stem
    ours = _chat(gguf_file_server.url, name, "What is the capital of France?")
    ref = _chat(smollm2_server.url, "default", "What is the capital of France?")
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]  # the same template, same tokens
    assert ours["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_no_float_copy_of_the_matrices_is_kept(gguf_file_server, smollm2_server):
    rss = lambda srv: max(psutil.Process(p).memory_info().rss for p in srv.pids())  # noqa: E731  the scheduler
    assert rss(smollm2_server) - rss(gguf_file_server) > FLOAT_BYTES / 2
