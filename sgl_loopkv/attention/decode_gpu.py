"""Sparse decode executors of one interface: each (sequence, KV head) attends its own key list.

    q, out       [B, Hq, D]        one query row per sequence (fp32, bf16 or fp16)
    k/v_cache    [P, Hkv, D]       one layer's pool buffers (q's dtype), rows contiguous
    head_indptr  [B * Hkv + 1]     int64; entry b * Hkv + h spans the keys KV head h of sequence b reads
    head_slots   [head_indptr[-1]] int64 pool slots of those keys, in position order
    out[b, qh] = softmax(q[b, qh] . K_sel^T * scale) V_sel for qh in h*g .. (h+1)*g - 1, g = Hq // Hkv

Softmax in fp32; an empty list gives zeros (selection policies never produce one). Three
implementations, each ``f(q, k_cache, v_cache, head_indptr, head_slots, scale, out) -> out``:

- :func:`sparse_decode_reference`: torch, vectorised over all lists (segment softmax); the CPU path
  and what the others are tested against.
- ``sgl_loopkv.kernels.sparse_decode_triton.sparse_decode_triton``: one Triton program per
  (sequence, KV head, split of its list), flash-decoding merge.
- :class:`FlashInferSparseDecode`: FlashInfer's paged decode with pages of one token and one KV
  head, so the lists are its page lists (one ``plan()`` per batch and layer, then ``run()``).

Tests: tests/unit/test_sparse_decode_gpu.py (CUDA; the reference on CPU too) and
tests/e2e/test_triton_interpreter.py (the Triton kernel under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sparse_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The contract in torch (module docstring), on q's device: every key of every list scored
    against its group's g query heads at once, a segment softmax per (list, query head)."""
    B, Hq, D = q.shape
    H = k_cache.shape[1]
    G, rows = Hq // H, B * H
    dt = torch.promote_types(q.dtype, torch.float32)
    indptr = head_indptr.to(q.device, torch.int64)
    slots = head_slots.to(q.device, torch.int64)
    row = torch.repeat_interleave(torch.arange(rows, device=q.device), indptr.diff(), output_size=slots.numel())
    head = row % H
    k = k_cache[slots, head].to(dt)  # [N, D]
    v = v_cache[slots, head].to(dt)
    qg = q.reshape(rows, G, D).to(dt)  # row b * H + h holds query heads h * G .. (h + 1) * G - 1
    s = torch.einsum("ngd,nd->ng", qg[row], k) * scale  # [N, G]
    m = torch.full((rows, G), -torch.inf, dtype=dt, device=q.device).scatter_reduce_(
        0, row[:, None].expand(-1, G), s, "amax"
    )
    p = (s - m[row]).exp()
    den = torch.zeros(rows, G, dtype=dt, device=q.device).index_add_(0, row, p)
    num = torch.zeros(rows, G, D, dtype=dt, device=q.device).index_add_(0, row, p[:, :, None] * v[:, None, :])
    out.copy_((num / den.clamp_min(torch.finfo(dt).tiny)[:, :, None]).view(B, Hq, D))
    return out


def pool_pages(head_indptr: torch.Tensor, head_slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """FlashInfer page ids of the lists: key ``j`` of row ``b * Hkv + h`` -> ``slot * Hkv + h`` (int32,
    on head_slots' device; no sync: the total is head_slots' length)."""
    indptr = head_indptr.to(head_slots.device, non_blocking=True)
    rows = indptr.numel() - 1
    head = torch.repeat_interleave(
        torch.arange(rows, device=head_slots.device) % num_kv_heads, indptr.diff(), output_size=head_slots.numel()
    )
    return (head_slots * num_kv_heads + head).to(torch.int32)


@dataclass(slots=True)
class DecodeRequests:
    """One planned call: FlashInfer requests = (sequence, KV head) rows, ``rows = B * num_kv_heads``;
    ``pages`` [N] int32 on the pool's device: page ``slot * num_kv_heads + head`` of the pool viewed
    as [P * num_kv_heads, 1 token, 1 head, D] (NHD). ``indptr``/``slots``/``scale``: the lists on the
    device, for the Triton kernel (fp32, ``fp32=True``: nothing planned in FlashInfer)."""

    rows: int
    num_kv_heads: int
    group: int
    pages: torch.Tensor
    indptr: torch.Tensor
    slots: torch.Tensor
    scale: float
    fp32: bool


class FlashInferSparseDecode:
    """:class:`flashinfer.BatchDecodeWithPagedKVCacheWrapper` driven by per-(sequence, KV head)
    lists: each row of ``head_indptr`` is one request with ``num_qo_heads = g`` and
    ``num_kv_heads = 1`` over pages of one token (q viewed as [B * Hkv, g, D], no copy for a
    contiguous q). Call :meth:`plan` once per (batch, layer) (the lists differ per layer), then
    :meth:`run`; ``__call__`` does both (the module's common signature).

    ``plan()`` needs the list lengths on the host: pass ``head_indptr`` on the CPU (pinned) to avoid
    a device sync. FlashInfer has no fp32 decode path here: fp32 runs the Triton kernel.
    ``use_tensor_cores``: FlashInfer's prefill kernels for decode (any group size); default (None)
    only for group sizes its CUDA-core decode kernel does not dispatch. flashinfer is imported on
    construction.
    """

    #: group sizes FlashInfer's CUDA-core decode kernel dispatches (DISPATCH_GQA_GROUP_SIZE in its
    #: include/flashinfer/utils.cuh: 1, 2, 3, 4, 8; others raise "Unsupported group_size")
    DECODE_GROUPS = (1, 2, 3, 4, 8)

    def __init__(self, workspace_bytes: int = 128 << 20, use_tensor_cores: bool | None = None, device="cuda"):
        import flashinfer

        self._fi = flashinfer
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._tensor_cores = use_tensor_cores
        self._wrappers: dict[bool, object] = {}  # by use_tensor_cores (one shared workspace: never concurrent)
        self._wrapper = None  # the one plan() went to
        self._planned: DecodeRequests | None = None

    def _wrapper_for(self, group: int):
        tc = self._tensor_cores if self._tensor_cores is not None else group not in self.DECODE_GROUPS
        if tc not in self._wrappers:
            self._wrappers[tc] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=tc
            )
        return self._wrappers[tc]

    def plan(
        self,
        head_indptr: torch.Tensor,
        head_slots: torch.Tensor,
        num_kv_heads: int,
        group: int,
        head_dim: int,
        scale: float,
        dtype: torch.dtype,
    ) -> DecodeRequests:
        """Page lists (device ops, no sync) and FlashInfer's ``plan()`` (host lengths)."""
        from sgl_loopkv.attention.sparse.flashinfer import _upload

        device = self._workspace.device
        pin = device.type == "cuda"
        rows, H = head_indptr.numel() - 1, num_kv_heads
        if head_indptr.device == device:
            host_indptr = head_indptr.cpu()  # on a GPU a sync: pass it on the host
            dev_indptr = head_indptr
        else:
            host_indptr = head_indptr
            (dev_indptr,) = _upload([head_indptr.numpy()], device, pin)
        # plan()'s host inputs, pinned (its copies to the device then need no sync); pages of one
        # token: every last page holds 1, and FlashInfer derives the lengths from indptr
        host = torch.empty(2 * rows + 1, dtype=torch.int32, pin_memory=pin)
        indptr32, last = host.split([rows + 1, rows])
        indptr32.copy_(host_indptr)
        last.fill_(1)
        slots = head_slots.to(device, non_blocking=True)
        pages = pool_pages(dev_indptr, slots, H)
        fp32 = dtype == torch.float32  # run() goes to the Triton kernel
        self._wrapper = None
        if not fp32:
            self._wrapper = self._wrapper_for(group)
            self._wrapper.plan(
                indptr32,
                pages,
                last,
                group,  # num_qo_heads
                1,  # num_kv_heads
                head_dim,
                1,  # page size
                sm_scale=scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        self._planned = DecodeRequests(rows, H, group, pages, dev_indptr, slots, scale, fp32)
        return self._planned

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The planned lists over this layer's pool buffers; writes and returns ``out`` [B, Hq, D]."""
        reqs = self._planned
        assert reqs is not None, "plan() first"
        B, Hq, D = q.shape
        assert B * k_cache.shape[1] == reqs.rows and Hq == reqs.rows // B * reqs.group, "q does not match the plan"
        if reqs.fp32:
            from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton

            return sparse_decode_triton(q, k_cache, v_cache, reqs.indptr, reqs.slots, reqs.scale, out)
        pages = lambda x: x.view(-1, 1, 1, x.shape[-1])  # noqa: E731  (raises for a non-contiguous pool)
        q_req = q.reshape(reqs.rows, reqs.group, D)
        if out.is_contiguous():
            self._wrapper.run(q_req, (pages(k_cache), pages(v_cache)), out=out.view(reqs.rows, reqs.group, D))
        else:
            out.copy_(self._wrapper.run(q_req, (pages(k_cache), pages(v_cache))).view(B, Hq, D))
        return out

    def __call__(self, q, k_cache, v_cache, head_indptr, head_slots, scale, out) -> torch.Tensor:
        """plan + run: the module's common signature."""
        self.plan(head_indptr, head_slots, k_cache.shape[1], q.shape[1] // k_cache.shape[1], q.shape[2], scale, q.dtype)
        return self.run(q, k_cache, v_cache, out)
