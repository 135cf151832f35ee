"""Restoration of returning conversations: per-layer recompute/load plans (Krul), a cost model
learnt on the running machine, and the front recompute that overlaps the loader thread."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sgl_loopkv.restore.plan import PLANNERS, CostModel, RestoreJob, RestorePlan, simulate
from sgl_loopkv.restore.recompute import LayerStack, SGLangLayerStack

__all__ = ["PLANNERS", "CostModel", "RestoreJob", "RestorePlan", "simulate", "LayerStack", "model_stack"]


def model_stack(model: torch.nn.Module, attend: Callable[..., torch.Tensor]) -> LayerStack | None:
    """SGLang's loaded model as a :class:`LayerStack`, or None (a model it does not support)."""
    try:
        return SGLangLayerStack(model, attend)
    except (AttributeError, NotImplementedError) as e:
        logging.getLogger(__name__).warning("loopkv: partial recompute unavailable (%s); restores load everything", e)
        return None
