"""LServe's streaming-head calibration procedure on the tiny model (saved with SmolLM2's tokenizer)."""

from __future__ import annotations

import torch


def test_calibration_procedure_runs_on_the_tiny_model(tiny_model_dir):
    from sgl_loopkv.attention.calibration.streaming import calibrate

    result = calibrate(
        tiny_model_dir, tokens=400, prompts=1, needles=2, sink=16, local=64, block_size=16, random_rows=16
    )
    scores = torch.tensor(result["retrieval_scores"])
    assert scores.shape == (2, 2) and ((scores >= 0) & (scores <= 1)).all() and scores.sum() > 0
    assert result["params"]["local"] == 64
