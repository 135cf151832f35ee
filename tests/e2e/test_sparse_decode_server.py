"""Sparse decode through the real server: at a budget covering the context every policy's plans run
through the sparse decoder and greedy output equals the dense server's, for a batch that mixes
sequences above and below the minimum context; below the budget the server reports what it read on
/metrics. The SmolLM2 check is marked slow."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.conftest import _server
from tests.e2e.test_server_tiny import LONG_PROMPT, generate

pytestmark = pytest.mark.server

PROMPTS = [LONG_PROMPT[:2000], LONG_PROMPT[:3500], "The capital of France is"]  # the last stays dense


def full_budget(policy: str) -> list[str]:
    return [
        "--loopkv-decode-policy", policy, "--loopkv-decode-budget", "65536",
        "--loopkv-decode-min-context", "256", "--enable-metrics",
    ]  # fmt: skip


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=30).text
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    assert values, f"{name} not on /metrics"
    return max(values)


def sparse_decode_batches(url: str) -> float:
    """Decode batches the sparse decoder ran (``loopkv_decode_batches{path="sparse-<policy>"}``)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r'^loopkv_decode_batches_total{path="sparse-[^"]*"} (\S+)$', text, re.M))


def answers(url: str, prompts: list[str], n: int = 24) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch of mixed lengths
        return list(pool.map(lambda p: generate(url, p, max_new_tokens=n, ignore_eos=True)["output_ids"], prompts))


def check_full_budget(srv, reference) -> None:
    assert answers(srv.url, PROMPTS) == answers(reference.url, PROMPTS)
    assert sparse_decode_batches(srv.url) > 0
    assert metric(srv.url, "loopkv_decode_selected_fraction") == 1.0
    assert metric(srv.url, "loopkv_decode_selections_total") > 0


def test_full_budget_sparse_decode_is_greedy_identical_to_dense(tiny_sparse_server, tiny_server):
    """LServe's selection (the session's sparse server: sparse prefill at full budget too)."""
    check_full_budget(tiny_sparse_server, tiny_server)


# the others share lserve's selector and executor (their full-budget exactness is in
# tests/unit/test_sparse_decode.py); their own server runs are slow
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["freekv", "loopserve"])
def test_full_budget_sparse_decode_of_other_policies_is_greedy_identical(
    policy, tiny_model_dir, server_logs, tiny_server
):
    with _server(tiny_model_dir, server_logs, f"tiny-decode-{policy}", full_budget(policy)).start() as srv:
        check_full_budget(srv, tiny_server)


@pytest.mark.slow  # the selector below budget is in tests/unit/test_sparse_decode.py
def test_below_budget_decode_reads_a_fraction_and_still_answers(tiny_model_dir, server_logs):
    args = ["--loopkv-decode-policy", "lserve", "--loopkv-decode-budget", "512", "--loopkv-decode-min-context",
            "1024", "--enable-metrics"]  # fmt: skip
    with _server(tiny_model_dir, server_logs, "tiny-decode-lserve-512", args).start() as srv:
        out = answers(srv.url, [LONG_PROMPT * 2], n=32)[0]
        assert len(out) == 32
        assert 0 < metric(srv.url, "loopkv_decode_selected_fraction") < 0.2  # 512 of ~5.4K keys


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["freekv", "loopserve", "lserve"])
def test_smollm2_full_budget_sparse_decode_is_greedy_identical(policy, default_model_dir, server_logs, smollm2_server):
    prompt = LONG_PROMPT + "\nWhat colour is item 7?"
    with _server(default_model_dir, server_logs, f"smollm2-decode-{policy}", full_budget(policy)).start() as srv:
        ours = generate(srv.url, prompt, max_new_tokens=64, ignore_eos=True)
        ref = generate(smollm2_server.url, prompt, max_new_tokens=64, ignore_eos=True)
        assert ours["output_ids"] == ref["output_ids"]
        assert sparse_decode_batches(srv.url) > 0
