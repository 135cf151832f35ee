"""What the served model runs on, as gauges on ``/metrics`` (``--enable-metrics``): whether the lean
forward runs its batches (``loopkv_lean_forward``), how many of its matrices are served from GGUF blocks
(``loopkv_gguf_layers``). Each is decided once per scheduler process, where the model is loaded or first
run, and set there."""

from __future__ import annotations

import os

#: name -> its gauge, created at first use (a Prometheus name may be registered once per process)
_GAUGES: dict = {}


def set_gauge(name: str, doc: str, value: float) -> None:
    """Set the gauge ``name`` if this process exports metrics: SGLang sets ``PROMETHEUS_MULTIPROC_DIR``
    for its processes only with ``--enable-metrics``, and a gauge must be made after it is set."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return
    gauge = _GAUGES.get(name)
    if gauge is None:
        from prometheus_client import Gauge

        gauge = _GAUGES[name] = Gauge(name, doc, multiprocess_mode="mostrecent")
    gauge.set(value)
