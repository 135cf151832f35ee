"""Sparse prefill through the real server: at full budget every policy's plan runs through the
sparse executor and greedy output equals the dense server's, including chunked-prefill extends
whose queries sit after a cached prefix. The tiny-model test is in the default suite, on the session's
``tiny_sparse_server`` (sparse decode at full budget too); the SmolLM2 ones (one server per policy)
are marked slow."""

from __future__ import annotations

import pytest

from benchmarks.common import metrics
from tests.e2e.conftest import _server
from tests.e2e.test_server_tiny import LONG_PROMPT, generate

pytestmark = pytest.mark.server

BATCHES = "loopkv_sparse_prefill_batches_total"  # prefill batches the sparse executor ran


def sparse_batches(url: str) -> float:
    return metrics(url).get(BATCHES, 0.0)


# Full budget: every line (alpha = 1), every block, or a window longer than any prompt.
MIN_LEN = ["--loopkv-prefill-min-len", "512", "--enable-metrics"]
FULL_BUDGET = {
    "loopserve": ["--loopkv-prefill-policy", "loopserve", "--loopkv-prefill-alpha", "1", *MIN_LEN],
    "block": ["--loopkv-prefill-policy", "block", "--loopkv-prefill-alpha", "1", *MIN_LEN],
    "lserve": ["--loopkv-prefill-policy", "lserve", "--loopkv-prefill-streaming-local", "8192", *MIN_LEN],
}


def test_full_budget_sparse_prefill_is_greedy_identical_to_dense(tiny_sparse_server, tiny_server):
    # tagged: nothing of them is cached from the other tests this session's server served
    before, tag = sparse_batches(tiny_sparse_server.url), "Sparse prefill. "
    prompts = ["The capital of France is", tag + LONG_PROMPT[:3000], tag + LONG_PROMPT * 2]  # dense, 1 chunk, 6
    for prompt in prompts:
        ours = generate(tiny_sparse_server.url, prompt, max_new_tokens=24, ignore_eos=True)
        ref = generate(tiny_server.url, prompt, max_new_tokens=24, ignore_eos=True)
        assert ours["output_ids"] == ref["output_ids"], prompt[:40]
        if prompt == prompts[0]:  # below --loopkv-prefill-min-len: dense, not counted
            assert sparse_batches(tiny_sparse_server.url) == before
    # a later turn: a long new extend after the radix-cached conversation
    turn = tag + LONG_PROMPT * 2 + " Now a new question follows. " + LONG_PROMPT[:2500]
    ours = generate(tiny_sparse_server.url, turn, max_new_tokens=24, ignore_eos=True)
    ref = generate(tiny_server.url, turn, max_new_tokens=24, ignore_eos=True)
    assert ours["meta_info"]["cached_tokens"] > 4000
    assert ours["output_ids"] == ref["output_ids"]
    ran = sparse_batches(tiny_sparse_server.url) - before
    assert ran >= 1 + 6 + 1, f"the long prefills must have gone through the sparse path ({ran} batches)"


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(FULL_BUDGET))
def test_smollm2_full_budget_greedy_identical_to_dense(policy, default_model_dir, server_logs, smollm2_server):
    prompt = LONG_PROMPT * 2  # ~5.4K tokens: two prefill chunks, the second after a 4096-token prefix
    with _server(default_model_dir, server_logs, f"smollm2-sparse-{policy}", FULL_BUDGET[policy]).start() as srv:
        ours = generate(srv.url, prompt, max_new_tokens=64, ignore_eos=True)
        ref = generate(smollm2_server.url, prompt, max_new_tokens=64, ignore_eos=True)
        assert ours["output_ids"] == ref["output_ids"]
        assert sparse_batches(srv.url) >= 2


@pytest.mark.slow
def test_smollm2_sparse_prefill_below_full_budget_stays_close(default_model_dir, server_logs, smollm2_server):
    """At the default alpha the answer to a short question about a long context still matches
    dense for its first tokens (a smoke check, not a quality claim: benchmarks/prefill.py measures)."""
    prompt = LONG_PROMPT + "\nQuestion: what colour is item 7? Answer: item 7 is a"
    with _server(
        default_model_dir,
        server_logs,
        "smollm2-sparse-loopserve-095",
        ["--loopkv-prefill-policy", "loopserve", *MIN_LEN],
    ).start() as srv:
        ours = generate(srv.url, prompt, max_new_tokens=4)
        ref = generate(smollm2_server.url, prompt, max_new_tokens=4)
        assert ours["output_ids"][:1] == ref["output_ids"][:1]
        assert sparse_batches(srv.url) >= 1
