"""Attention as plan + execute: planners decide which KV slots each query row sees (per batch),
executors compute exactly that. ``backend.py`` is the thin SGLang glue. Sparse prefill: selection
policies (``policies/``) turn a layer's q/k into a :class:`SeqMask`; sparse executors
(``sparse/``: registry, base, torch, triton, flashinfer) run the resulting :class:`SparsePlan`."""

from sgl_loopkv.attention.executor import EXECUTORS, AttentionExecutor, dense_attention
from sgl_loopkv.attention.plan import AttentionPlan, build_dense_plan
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan

__all__ = [
    "EXECUTORS",
    "AttentionExecutor",
    "AttentionPlan",
    "SeqMask",
    "SparsePlan",
    "build_dense_plan",
    "dense_attention",
]
