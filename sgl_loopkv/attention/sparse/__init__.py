"""Sparse executors: run a :class:`~sgl_loopkv.attention.sparse_plan.SparsePlan` exactly, chosen
by name (``--loopkv-prefill-executor``).

The registry and its deferred factories live here, the contract and the shared per-sequence loop
in ``base.py``; each backend file imports only the base (and its own kernel library, on first use):

- ``torch``: gather-based block-sparse attention on torch's CPU flash kernel (``torch.py``);
- ``triton``: the Triton block-sparse kernel of ``sgl_loopkv.kernels`` (GPU, or CPU interpreted);
- ``flashinfer``: one FlashInfer paged-prefill plan + run per layer for every sparse sequence (CUDA).
"""

from __future__ import annotations

from sgl_loopkv.attention.executor import AttentionExecutor
from sgl_loopkv.attention.sparse.base import SparseExecutor, one_sequence, run_dense
from sgl_loopkv.registry import Registry

__all__ = ["SPARSE_EXECUTORS", "SparseExecutor", "one_sequence", "run_dense"]

SPARSE_EXECUTORS: Registry[SparseExecutor] = Registry("sparse attention executor")


@SPARSE_EXECUTORS.register("torch")
def _torch(dense: AttentionExecutor | None = None) -> SparseExecutor:
    from sgl_loopkv.attention.sparse.torch import TorchSparseExecutor

    return TorchSparseExecutor(dense)


@SPARSE_EXECUTORS.register("triton")
def _triton(dense: AttentionExecutor | None = None) -> SparseExecutor:
    from sgl_loopkv.attention.sparse.triton import TritonSparseExecutor

    return TritonSparseExecutor(dense)


@SPARSE_EXECUTORS.register("flashinfer")
def _flashinfer(dense: AttentionExecutor | None = None) -> SparseExecutor:
    from sgl_loopkv.attention.sparse.flashinfer import FlashInferSparseExecutor

    return FlashInferSparseExecutor(dense)
