"""Restoration of returning conversations: per-layer recompute/load plans (Krul), a cost model
learnt on the running machine, and the front recompute that overlaps the loader thread."""

from __future__ import annotations

from collections.abc import Callable

from sgl_loopkv.restore.plan import PLANNERS, CostModel, RestoreJob, RestorePlan, simulate
from sgl_loopkv.restore.recompute import LayerStack, SGLangLayerStack

__all__ = ["PLANNERS", "CostModel", "RestoreJob", "RestorePlan", "simulate", "LayerStack", "set_model", "model_stack"]

_model: Callable[[], object] | None = None


def set_model(getter: Callable[[], object]) -> None:
    """The loopkv attention backend registers its model runner's model here (scheduler process)."""
    global _model
    _model = getter


def model_stack() -> LayerStack | None:
    """SGLang's loaded model as a :class:`LayerStack`, or None (no loopkv attention, other model)."""
    if _model is None:
        return None
    try:
        return SGLangLayerStack(_model())
    except (AttributeError, NotImplementedError) as e:
        import logging

        logging.getLogger(__name__).warning("loopkv: partial recompute unavailable (%s); restores load everything", e)
        return None
