"""GPU executor: a :class:`SparsePlan` run by FlashInfer's paged prefill kernel (page size 1).

Every (sequence, sparse KV head, query block) becomes one FlashInfer request whose KV "pages" are
exactly the keys its mask lists, ordered [selected earlier blocks, columns no block holds,
diagonal block]. FlashInfer's causal mask aligns a request's last query with its last key, so
with the diagonal block last, every earlier key is visible to all rows and the diagonal block is
causal: the mask's semantics exactly. One ``plan()`` per KV head per layer (the plan is per layer:
online policies look at each layer's q/k), then one ``run()``. Full heads and dense sequences run
:func:`dense_attention` (torch SDPA on the GPU).

Imported only when CUDA is present (``--loopkv-sparse-executor flashinfer``); tests in
tests/test_sparse_gpu.py run only there. NOT YET RUN on a GPU: the development machines of this
issue had none.
"""

from __future__ import annotations

import torch

from sgl_loopkv.attention.executor import EXECUTORS, AttentionExecutor, dense_attention
from sgl_loopkv.attention.sparse_executor import SparseExecutor, run_dense
from sgl_loopkv.attention.sparse_plan import SeqMask


def request_keys(mask: SeqMask, head: int) -> list[torch.Tensor]:
    """Per query block of ``head``: the key positions of its request, diagonal block last."""
    B, L, qb0 = mask.block_size, mask.kv_len, mask.first_q_block
    cols = mask.cols(head)
    table = mask.block_table()[head]
    out = []
    for j in range(mask.num_q_blocks):
        b = qb0 + j
        blocks = mask.blocks(head, b)[:-1]  # ascending; the diagonal is the last entry
        early = (blocks[:, None] * B + torch.arange(B)).reshape(-1)
        extra = cols[(cols < b * B) & ~table[j, cols // B]]
        out.append(torch.cat([early, extra, torch.arange(b * B, min(L, b * B + B))]))
    return out


class FlashInferSparseExecutor(SparseExecutor):
    def __init__(self, dense: AttentionExecutor | None = None, workspace_bytes: int = 128 << 20):
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.dense = dense or EXECUTORS.create("torch")

    def run(self, plan, q, k_cache, v_cache, scale, out):
        base = plan.base
        Hq, H = q.shape[1], k_cache.shape[1]
        G = Hq // H
        for i, mask in enumerate(plan.masks):
            q0, q1 = base.qo_indptr[i], base.qo_indptr[i + 1]
            if q0 == q1:
                continue
            if mask is None:
                run_dense(self.dense, base, i, q, k_cache, v_cache, scale, out)
                continue
            k, v = base.kv_of(i, k_cache), base.kv_of(i, v_cache)
            for h in range(H):
                heads = slice(h * G, (h + 1) * G)
                if mask.full[h]:
                    out[q0:q1, heads] = dense_attention(q[q0:q1, heads], k[:, h : h + 1], v[:, h : h + 1], scale)
                else:
                    out[q0:q1, heads] = self._run_head(mask, h, q[q0:q1, heads], k[:, h], v[:, h], scale)
        return out

    def _run_head(self, mask: SeqMask, h: int, q, k, v, scale):
        """q [n, G, D] of one KV head's group; k, v [L, D] -> [n, G, D]."""
        B, P, L = mask.block_size, mask.prefix_len, mask.kv_len
        keys = request_keys(mask, h)
        starts = [(mask.first_q_block + j) * B for j in range(mask.num_q_blocks)]
        q_rows = [min(L, s + B) - max(P, s) for s in starts]
        qo_indptr = torch.tensor([0, *q_rows]).cumsum(0).to(torch.int32)
        kv_indptr = torch.tensor([0, *(len(x) for x in keys)]).cumsum(0).to(torch.int32)
        wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        wrapper.plan(
            qo_indptr.to(q.device),
            kv_indptr.to(q.device),
            torch.cat(keys).to(device=q.device, dtype=torch.int32),
            torch.ones(len(keys), dtype=torch.int32, device=q.device),  # page size 1: last page full
            q.shape[1],
            1,
            q.shape[2],
            1,
            causal=True,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=k.dtype,
        )
        pages = lambda x: x.reshape(L, 1, 1, -1).contiguous()  # noqa: E731  [pages, page_size, kv heads, D]
        return wrapper.run(q.contiguous(), (pages(k), pages(v)))
