"""Answers near the KV pool's size have the length they ask for, as from stock SGLang on the same
``--max-total-tokens`` (issue 54): a conversation's turn resumed from the host tier or from the disk
tier, at prompt lengths up to the longest that stock SGLang answers in full.

The paged cache's page rounding (``server/pool_size.py``) had cut such answers short on arrival: a
982-token prompt asking for 16 tokens got 15, a 1000-token one none, fresh or resumed alike."""

from __future__ import annotations

import random

import pytest
import requests

from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS

pytestmark = pytest.mark.server

POOL, ANSWER = 1024, 16
# 1006 = POOL - ANSWER - 2: the longest prompt stock SGLang's page-1 pool answers with ANSWER tokens
LENGTHS = (982, 994, 1000, 1006)
HISTORY = 480  # the first turn's prompt: resumed from a tier in the second turn
EVICTOR = 900  # another conversation's turn between the two: the history leaves the device pool
START_S = 1500  # on a shared 2-core machine a server start can take many minutes


def conversation(length: int) -> tuple[list[int], list[int], list[int]]:
    """(first turn's prompt, the other conversation's prompt, the second turn's new tokens) for a
    second turn of ``length`` prompt tokens; random ids (a random-weight model), seeded per length."""
    rng = random.Random(length)

    def ids(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    return ids(HISTORY), ids(EVICTOR), ids(length - HISTORY - ANSWER)


def generate(url: str, ids: list[int], max_new_tokens: int = ANSWER) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def second_turns(url: str) -> dict[int, dict]:
    """Per length: the second turn's response (its first turn and the other conversation's ran first)."""
    out = {}
    for length in LENGTHS:
        first, other, new = conversation(length)
        history = first + generate(url, first)["output_ids"]
        generate(url, other, 4)
        prompt = history + new
        assert len(prompt) == length
        out[length] = generate(url, prompt)
    return out


def answered(resp: dict) -> tuple[int, object]:
    return len(resp["output_ids"]), resp["meta_info"]["finish_reason"]


def server(tiny_model_dir, log, extra: list[str]) -> ServerProcess:
    args = ["--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:], "--max-total-tokens", str(POOL), *extra]
    return ServerProcess(args, log_path=log)


EXPECTED = (ANSWER, {"type": "length", "length": ANSWER})


@pytest.mark.slow  # the reference behind EXPECTED: a server start of its own
def test_stock_answers_each_second_turn_in_full(tiny_model_dir, server_logs):
    with server(tiny_model_dir, server_logs / "answer-length-stock.log", ["--loopkv-stock"]).start(START_S) as srv:
        stock = {length: answered(resp) for length, resp in second_turns(srv.url).items()}
    assert stock == dict.fromkeys(LENGTHS, EXPECTED)


@pytest.mark.parametrize(
    "tier, flags",
    [
        ("host", ["--loopkv-tier-disk-dir", "none"]),
        pytest.param("storage", ["--loopkv-tier-host-bytes", "0"], marks=pytest.mark.slow),  # the same path from disk
    ],
    ids=["host", "disk"],
)
def test_resumed_turns_near_the_pool_size_answer_in_full_like_stock(tier, flags, tiny_model_dir, server_logs):
    with server(tiny_model_dir, server_logs / f"answer-length-{tier}.log", flags).start(START_S) as srv:
        turns = second_turns(srv.url)
    for length, resp in turns.items():
        details = resp["meta_info"]["cached_tokens_details"]
        assert details[tier] >= HISTORY - 16, (length, details)  # the history came back from that tier
        assert answered(resp) == EXPECTED, (length, details)  # what stock answers (the slow test above)
