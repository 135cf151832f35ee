"""Per-model calibration files for static sparsity (LServe's streaming heads).

One small JSON file per model, ``<model folder name>.json`` in this directory (or a path given
with ``--loopkv-prefill-streaming-calibration``), written by :mod:`.streaming` (``python -m
sgl_loopkv.attention.calibration --model-path DIR``): a retrieval score per (layer, KV head),
high = the head needs far context. The serving flag ``--loopkv-prefill-streaming-fraction`` picks how many
of the lowest-scoring heads stream, so one file serves every fraction.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CALIBRATION_DIR = Path(__file__).resolve().parent


def calibration_path(model_name: str) -> Path:
    return CALIBRATION_DIR / f"{model_name.lower()}.json"


def load_head_scores(model_name: str, num_layers: int, num_kv_heads: int, path: str | None = None) -> torch.Tensor:
    """Retrieval scores float [num_layers, num_kv_heads] of a model; fails loudly, with the command
    that calibrates it, when there is no file or its shape does not match the model."""
    file = Path(path) if path else calibration_path(model_name)
    if not file.exists():
        raise FileNotFoundError(
            f"no streaming-head calibration for model {model_name!r} ({file}); create it with "
            f"`python -m sgl_loopkv.attention.calibration --model-path <model dir>` "
            "or pass --loopkv-prefill-streaming-calibration FILE"
        )
    data = json.loads(file.read_text())
    scores = torch.tensor(data["retrieval_scores"], dtype=torch.float64)
    if tuple(scores.shape) != (num_layers, num_kv_heads):
        raise ValueError(
            f"{file}: scores for {tuple(scores.shape)} (layers, kv heads), model has {(num_layers, num_kv_heads)}"
        )
    return scores
