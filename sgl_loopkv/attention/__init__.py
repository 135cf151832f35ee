"""Attention as plan + execute: planners decide which KV slots each query row sees (per batch),
executors compute exactly that. ``backend.py`` is the thin SGLang glue."""

from sgl_loopkv.attention.executor import EXECUTORS, AttentionExecutor, dense_attention
from sgl_loopkv.attention.plan import AttentionPlan, build_dense_plan

__all__ = ["EXECUTORS", "AttentionExecutor", "AttentionPlan", "build_dense_plan", "dense_attention"]
