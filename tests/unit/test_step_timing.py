"""The served decode step's timing (sgl_loopkv/models/step_timing.py): parts add up per step, the LM
head counts only after a decode step's forward, and a process without metrics times nothing."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from sgl_loopkv.models import step_timing
from sgl_loopkv.models.step_timing import StepTiming


def value(reg: CollectorRegistry, name: str, **labels) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_a_decode_steps_parts_are_published_once_its_forward_is_done():
    reg = CollectorRegistry()
    t = StepTiming(reg)
    weights = t.timed(lambda x: time.sleep(0.01) or x + 1, "weights")
    attention = t.timed(lambda: time.sleep(0.005), "attention")
    for _ in range(2):
        t.begin(True)
        assert weights(1) == 2
        attention()
        assert value(reg, "loopkv_decode_steps_total") < 2
        t.publish(0.05)
        t.add_lm_head(0.002)
    assert value(reg, "loopkv_decode_steps_total") == 2
    assert value(reg, "loopkv_decode_seconds_total", part="forward") == 0.1
    assert 0.02 <= value(reg, "loopkv_decode_seconds_total", part="weights") < 0.05
    assert 0.01 <= value(reg, "loopkv_decode_seconds_total", part="attention") < 0.04
    assert value(reg, "loopkv_decode_seconds_total", part="lm_head") == 0.004


def test_another_batchs_lm_head_and_a_failing_call_are_not_a_steps():
    reg = CollectorRegistry()
    t = StepTiming(reg)
    t.begin(False)  # an extend: its LM head is not a decode step's
    t.add_lm_head(1.0)
    assert value(reg, "loopkv_decode_seconds_total", part="lm_head") == 0.0

    def boom():
        raise ValueError("x")

    t.begin(True)
    try:
        t.timed(boom, "weights")()
    except ValueError:
        pass
    assert t.part["weights"] > 0  # the time still counts; the error is the caller's
    t.begin(True)
    assert t.part == {"weights": 0.0, "attention": 0.0}


def test_no_metrics_no_timing(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    step_timing.active.cache_clear()
    try:
        assert step_timing.active() is None
    finally:
        step_timing.active.cache_clear()
