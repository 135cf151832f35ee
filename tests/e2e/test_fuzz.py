"""The fast part of the API fuzz (benchmarks/fuzz.py, issue 16): schemathesis cases of the generation
endpoints and every hand-written bad input against one tiny-model server with the benchmark's caps.
No 5xx, no server path or traceback in an answer, bad input answered with a readable 4xx, and the
server alive after (server/errors.py, server/request_checks.py)."""

from __future__ import annotations

import pytest

from benchmarks.studies.fuzz import CORE_OPERATIONS, fuzz, healthy

pytestmark = pytest.mark.server

EXAMPLES = 7  # per operation and generation mode: about 60 generated cases over CORE_OPERATIONS


def test_fuzzed_and_hand_written_bad_input_gets_readable_4xx_and_no_crash(fuzz_server):
    assert healthy(fuzz_server.url, wait_s=120)  # SGLang answers 503 until its warm-up is over
    payload = fuzz(fuzz_server.url, EXAMPLES, CORE_OPERATIONS, progress=False)
    s = payload["summary"]
    assert s["generated_cases"] >= 45 and s["hand_written_cases"] >= 50, s  # the fuzz really ran
    assert s["server_errors"] == 0, payload["server_error_samples"]
    assert s["path_leaks"] == 0, payload["path_leak_samples"]
    assert s["transport_errors"] == 0, payload["transport_error_samples"]
    assert s["unreadable_errors"] == 0, payload["unreadable_error_samples"]
    assert s["hand_written_unexpected"] == 0, [r for r in payload["hand_written"] if not r["ok"]]
    assert s["crashes"] == 0 and s["health_after"] and s["generate_after"] == 200, payload["crashes"]
