"""Decode over a fragmented KV pool in a real server: a small device pool, conversations evicted to
the host tier and resumed into whatever pages are free, several of them decoding together. The
decode path taken is read from ``/metrics`` and greedy output must equal a server that never
evicted (torch_native attention, large pool)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS

pytestmark = pytest.mark.server

N_CONV = 5


def history(i: int) -> str:
    facts = " ".join(
        f"Note {i}.{j}: shelf {j} keeps {(i * 5 + j) % 9} jars of {['tea', 'salt'][j % 2]}." for j in range(30)
    )
    return f"Conversation {i}. {facts}"  # ~450 tokens


def ask(url: str, input_ids: list[int]) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def decode_batches(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r'loopkv_decode_batches_total\{path="(\w+)"\} ([0-9.e+]+)', text)}


def play(url: str, tokenizer, pool: ThreadPoolExecutor) -> tuple[list[list[int]], int]:
    """Three turns of every conversation, played concurrently: each turn's prompt is the history so
    far (earlier answers included, whose pages were allocated while the others decoded) plus a new
    question. Returns every answer and how many turns resumed from the host tier."""
    convs = [tokenizer(history(i))["input_ids"] for i in range(N_CONV)]
    answers, resumed = [], 0
    for r in range(3):
        convs = [c + tokenizer(f" Question {r}: how many jars on shelf {r + 2}?")["input_ids"] for c in convs]
        outs = list(pool.map(lambda c: ask(url, c), convs))
        convs = [c + o["output_ids"] for c, o in zip(convs, outs)]
        answers += [o["output_ids"] for o in outs]
        resumed += sum((o["meta_info"].get("cached_tokens_details") or {}).get("host", 0) > 0 for o in outs)
    return answers, resumed


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# slow (60 s with its reference server): the default suite checks the executor on a fragmented pool
# in-process (tests/unit/test_paged_decode.py) and decode after resumes in every tiered-cache test
@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-paths"])
def test_decode_after_resumes_into_a_fragmented_pool(
    native, tiny_model_dir, tiny_native_server, server_logs, tokenizer
):
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "1536"),  # ~3 conversations: the others are evicted and come back
        "--enable-metrics",
    ]
    env = {} if native else {"LOOPKV_NATIVE_DECODE": "0"}
    log = server_logs / f"decode-fragmented-{'native' if native else 'torch'}.log"
    with ThreadPoolExecutor(N_CONV) as pool:
        reference, _ = play(tiny_native_server.url, tokenizer, pool)
        with ServerProcess(args, env=env, log_path=log).start() as srv:
            answers, resumed = play(srv.url, tokenizer, pool)
            paths = decode_batches(srv.url)
    assert answers == reference
    assert resumed >= 2, "histories must have been evicted to the host tier and resumed"
    if native:
        assert paths.get("native", 0) > 0 and set(paths) == {"native"}, paths
    else:  # resumed histories sit on scattered pages: the measured rule must have gathered
        assert paths.get("gather", 0) > 0 and "native" not in paths, paths
