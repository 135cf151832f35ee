"""Dense attention on CUDA through SGLang's own backend objects (FlashInfer, else Triton).

On a GPU the loopkv backend keeps its plans for what is its own (sparse prefill and decode, chunk-
pruned restores) and hands every plain dense batch to an instance of SGLang's FlashInfer backend:
its wrappers are planned once per batch in ``init_forward_metadata`` and reused by every layer, as
SGLang does, and its numbers are SGLang's (greedy outputs equal to ``--attention-backend
flashinfer`` at full budget). Reused, not copied: a new SGLang version brings its own planning.

``LOOPKV_CUDA_DENSE`` chooses: ``auto`` (default: flashinfer when it imports, else triton),
``flashinfer``, ``triton``, or ``torch`` (the loopkv torch executor, the CPU path's code). Not run on
a GPU yet (docs/gpu.md); the launcher keeps loopkv attention opt-in on CUDA until it has been.
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

ENV = "LOOPKV_CUDA_DENSE"
CHOICES = ("auto", "flashinfer", "triton", "torch")


def dense_choice(device: str, env: dict | None = None) -> str:
    """Which dense path a backend on ``device`` takes: 'torch' off CUDA, else ``LOOPKV_CUDA_DENSE``."""
    value = (os.environ if env is None else env).get(ENV, "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{ENV} must be one of {CHOICES}, not {value!r}")
    if not str(device).startswith("cuda"):
        return "torch"
    if value == "auto":
        return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"
    return value


def sglang_dense_backend(model_runner):
    """SGLang's dense attention backend for this runner (None: the loopkv torch executor)."""
    choice = dense_choice(model_runner.device)
    if choice == "flashinfer":
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

        backend = FlashInferAttnBackend(model_runner)
    elif choice == "triton":
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        backend = TritonAttnBackend(model_runner)
    else:
        return None
    logger.info("loopkv attention: dense batches through SGLang's %s backend", choice)
    return backend
