"""benchmarks/fuzz.py's classification: what counts as a 5xx, a leak, an unreadable error (the e2e
fuzz test relies on these to fail when the server misbehaves)."""

from __future__ import annotations

import json
import sys

from benchmarks.studies.fuzz import MAX_GEN, Tally, clamp_body, error_message, find_leak, hand_written_cases

SGLANG_FILE = f"{sys.prefix}/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py"


def test_clamp_body_bounds_lengths_and_fanout_at_any_depth():
    body = {"max_tokens": 10**9, "n": 50, "options": {"num_predict": 99}, "sampling_params": [{"max_new_tokens": 7}]}
    assert clamp_body(body) == {
        "max_tokens": MAX_GEN,
        "n": 2,
        "options": {"num_predict": MAX_GEN},
        "sampling_params": [{"max_new_tokens": MAX_GEN}],
    }
    assert clamp_body({"max_tokens": -5, "n": True}) == {"max_tokens": -5, "n": True}  # the server's to reject


def test_leaks_are_server_paths_in_errors_and_tracebacks_anywhere():
    paths = Tally().paths
    assert find_leak(f'File "{SGLANG_FILE}", line 1870, in f', "", True, paths)
    assert find_leak(f"no such file {SGLANG_FILE}", "", True, paths) == SGLANG_FILE
    assert find_leak(f"model at {SGLANG_FILE}", "", False, paths) is None  # a 200 of an info endpoint
    assert find_leak("Traceback (most recent call last):", "", False, paths)
    assert find_leak(f"unknown model {sys.prefix}/x", f"model={sys.prefix}/x", True, paths) is None  # an echo
    assert find_leak("see /v1/chat/completions", "", True, paths) is None


def test_tally_counts_5xx_in_stream_errors_and_unreadable_4xx():
    t = Tally()
    t.record("op", 500, "Internal Server Error", "r")
    t.record("op", 200, 'data: {"error": {"message": "x", "code": 503}}\n\n', "r", "text/event-stream")
    t.record("op", 400, "<html>bad</html>", "r")
    t.record("op", 400, json.dumps({"object": "error", "message": "n must be >= 1", "code": 400}), "r")
    t.record("op", None, "ConnectionError", "r")
    s = t.summary()
    assert (s["cases"], s["server_errors"], s["unreadable_errors"], s["transport_errors"]) == (5, 2, 1, 1)


def test_error_message_reads_every_adapter_shape():
    assert error_message('{"object": "error", "message": "m"}') == "m"
    assert error_message('{"error": {"message": "m"}}') == "m"
    assert error_message('{"error": "m"}') == "m"
    assert error_message('{"detail": [{"msg": "m"}]}') == "m"
    assert error_message('{"detail": ""}') is None and error_message("oops") is None


def test_hand_written_cases_have_unique_names_per_endpoint():
    keys = [(c.method, c.path, c.name) for c in hand_written_cases()]
    assert len(keys) == len(set(keys)) and len(keys) >= 50
