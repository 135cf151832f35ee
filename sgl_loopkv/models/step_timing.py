"""Where a served decode step goes, on ``/metrics`` (``--enable-metrics``).

``loopkv_decode_seconds_total{part}`` and ``loopkv_decode_steps_total``, over the decode batches the lean
forward runs (:mod:`sgl_loopkv.models.lean_forward`):

- ``forward``: the model's layers, embedding to final norm;
- ``weights``: their projections (q/k/v, o, gate/up, down: the block matrices on the GGUF path);
- ``attention``: their attention calls (the KV write and the decode kernel);
- ``lm_head``: the LM head of those steps.

Per step, ``forward - weights - attention`` is the layers' glue (norms, rotary embedding, activation,
Python) and a client's inter-token time minus ``forward + lm_head`` is the rest of SGLang's step
(scheduling, sampling, streaming). ``benchmarks/decode.py`` reports them as its step breakdown.

Timed only in a process that exports metrics (SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` for its
processes with ``--enable-metrics``): elsewhere :func:`active` is None and the forward calls its
functions directly, with no timer on its path.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

PARTS = ("forward", "weights", "attention", "lm_head")


class StepTiming:
    """Seconds per part of the current decode step, published once its forward is done."""

    def __init__(self, registry=None):
        from prometheus_client import REGISTRY, Counter

        reg = REGISTRY if registry is None else registry
        self.seconds = Counter(
            "loopkv_decode_seconds", "Seconds of served decode steps, by part", ["part"], registry=reg
        )
        self.steps = Counter("loopkv_decode_steps", "Decode steps timed in loopkv_decode_seconds", registry=reg)
        self.part = {"weights": 0.0, "attention": 0.0}
        self.decoding = False  # the last forward was a timed decode step (its LM head comes next)

    def timed(self, fn: Callable, part: str) -> Callable:
        """``fn`` with its wall time added to ``part`` of the current step."""

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.part[part] += time.perf_counter() - t0

        return call

    def begin(self, decode: bool) -> None:
        """A forward starts: a decode step (timed) or another batch (its LM head is not counted)."""
        self.decoding = decode
        for k in self.part:
            self.part[k] = 0.0

    def publish(self, forward_s: float) -> None:
        """The decode step's forward took ``forward_s``: add it and its parts to the counters."""
        self.seconds.labels(part="forward").inc(forward_s)
        for k, v in self.part.items():
            self.seconds.labels(part=k).inc(v)
        self.steps.inc()

    def add_lm_head(self, seconds: float) -> None:
        if self.decoding:
            self.seconds.labels(part="lm_head").inc(seconds)


@functools.cache
def active() -> StepTiming | None:
    """This process's timing, or None when it exports no metrics (decided at its first decode step)."""
    return StepTiming() if "PROMETHEUS_MULTIPROC_DIR" in os.environ else None
