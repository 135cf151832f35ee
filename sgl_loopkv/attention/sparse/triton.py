"""The Triton block-sparse kernel (``sgl_loopkv.kernels.block_sparse_attn``) as a sparse executor:
GPU, or CPU under ``TRITON_INTERPRET=1`` (slow: tests only). Triton is imported on first use."""

from __future__ import annotations

from sgl_loopkv.attention.sparse.base import SparseExecutor


class TritonSparseExecutor(SparseExecutor):
    """One kernel call per masked sequence; sequences without a mask go to the dense executor."""

    def attend(self, q, k, v, mask, scale):
        from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention

        return block_sparse_attention(q, k, v, mask, scale)
