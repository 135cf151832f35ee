"""Attention executors: run a plan over the KV pool. One interface, chosen by name.

An executor owns no scheduling decisions: it computes exactly the attention its plan describes.
The torch executor here is the CPU path (and the correctness reference for every other one).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections import Counter
from enum import StrEnum

import torch
import torch.nn.functional as F

from sgl_loopkv.attention.plan import AttentionPlan
from sgl_loopkv.models import precision
from sgl_loopkv.registry import Registry


class AttentionExecutor(ABC):
    """Computes ``out[rows of seq i] = softmax(q_i K_i^T * scale + causal mask) V_i`` for a plan.

    Shapes: ``q`` and ``out`` are [num_q_tokens, num_q_heads, head_dim]; ``k_cache``/``v_cache``
    are the pool's per-layer buffers [pool_slots, num_kv_heads, head_dim]. ``num_q_heads`` is a
    multiple of ``num_kv_heads`` (GQA: consecutive query heads share one KV head).
    """

    @abstractmethod
    def run(
        self,
        plan: AttentionPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor: ...


EXECUTORS: Registry[AttentionExecutor] = Registry("attention executor")


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """Attention of ``n`` new query rows over ``L >= n`` keys whose last ``n`` are the rows' own.

    q: [n, Hq, D]; k, v: [L, Hkv, D] -> [n, Hq, D]. With ``causal`` row ``r`` sees keys
    ``0 .. L - n + r``: only the new rows are computed, the cached prefix costs O(n * L), not
    O(L^2) (SGLang's torch_native pads q to L rows and runs a full causal square instead). A bfloat16
    prefill over a bfloat16 pool on bfloat16 units takes :func:`prefill_kernel` (:func:`split_bf16_applies`).
    """
    n, L = q.shape[0], k.shape[0]
    if causal and n >= PREFILL_NATIVE_MIN_ROWS and split_bf16_applies(q, k) and (mod := prefill_kernel()) is not None:
        return mod.flash_split(q if q.stride(-1) == 1 else q.contiguous(), k, v, scale, precision.split_softmax())
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, D]
    if kh.dtype != qh.dtype:
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    mask, is_causal = None, False
    if causal and n == L:
        is_causal = True
    elif causal and n > 1:
        if _FLASH_LSE is not None and q.device.type == "cpu" and n >= LSE_MERGE_MIN_ROWS:
            return _prefix_then_causal(qh, kh, vh, scale).transpose(0, 1)
        pos = torch.arange(L - n, L, device=q.device).unsqueeze(1)
        mask = torch.arange(L, device=q.device).unsqueeze(0) <= pos  # [n, L] True = attend
    # 4-D: with 3-D inputs CUDA SDPA falls back to its math kernel (65x slower at 8K on an H100,
    # out of memory at 32K); the CPU kernels are indifferent.
    o = F.scaled_dot_product_attention(
        qh[None],
        kh[None],
        vh[None],
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=qh.shape[0] != kh.shape[0],
    )
    return o[0].transpose(0, 1)


#: New rows from which a causal extend of float32 queries over bfloat16 keys takes the split-bfloat16
#: kernel (:func:`prefill_kernel`); fewer rows are a decode step's or a short turn's, whose own paths
#: stay float32. The kernel's fixed cost (packing the keys) is paid once per call for all its rows.
PREFILL_NATIVE_MIN_ROWS = 64


def split_bf16_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`prefill_kernel` runs this extend: a float32 model over a bfloat16 pool on CPU (the
    GGUF path's), head dim a multiple of 64, each row's last dim contiguous, in a process whose prefills
    run on bfloat16 units (``--loopkv-prefill-dtype``, :mod:`sgl_loopkv.models.precision`)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k.dtype == torch.bfloat16
        and q.shape[-1] % 64 == 0
        and k.stride(-1) == 1
        and precision.prefill_bf16()
    )


@functools.cache
def prefill_kernel():
    """``kernels/prefill_attention.cpp`` (float32 queries split in two bfloat16 parts, so bfloat16 units
    run the products at close to float32 accuracy) where the CPU has AMX-BF16 or AVX512-BF16, read at
    run time; else None and torch's float32 flash kernel runs over the widened keys (without them
    bfloat16 GEMMs are emulated, slower than float32).
    ``LOOPKV_NATIVE_PREFILL_ATTENTION=0`` turns it off. Decided at the first such extend of the process
    (``loopkv_prefill_attention`` on ``/metrics``)."""
    from sgl_loopkv.kernels import prefill_attention
    from sgl_loopkv.models.metrics import set_gauge
    from sgl_loopkv.platform import cpu_has_native_bf16

    mod = prefill_attention.load() if cpu_has_native_bf16() else None
    mod = mod if mod is not None and mod.available() else None
    set_gauge(
        "loopkv_prefill_attention",
        "1: long extends over a bfloat16 pool run the split-bfloat16 kernel",
        int(mod is not None),
    )
    return mod


#: torch's CPU flash-attention op, which also returns each row's log-sum-exp (a torch private: when
#: a torch upgrade drops it, extends fall back to the masked SDPA call; tests cover both).
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: New rows from which the log-sum-exp merge beats one masked call. One layer, 9/3 heads, D 64,
#: masked / merge time (2026-11-24): 870 over 2600 cached 1.28, 256 over 2600 1.66, 64 over 2600
#: 1.09, 48 over 2000 and 32 over 500 1.01; below that the flash op's fixed cost loses (9 over
#: 1000 0.65, 16 over 16 0.59). A returning turn's extend (hundreds of rows) takes the merge.
LSE_MERGE_MIN_ROWS = 64


def attend_with_lse(q, k, v, scale, attn_mask=None, causal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of softmax attention. q [b, hq, m, D]; k, v [b, hk, s, D] with hq a multiple
    of hk; ``attn_mask`` additive, broadcastable to [b, hq, m, s]; ``causal``: m == s, row r sees 0..r.

    On CPU this is torch's flash-attention kernel (what SDPA runs), called directly because SDPA
    does not return the log-sum-exp needed to merge partial results; elsewhere a plain reference."""
    if q.device.type == "cpu" and _FLASH_LSE is not None:
        return _FLASH_LSE(q, k, v, is_causal=causal, attn_mask=attn_mask, scale=scale)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)).float() * scale
    if attn_mask is not None:
        s = s + attn_mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    lse = s.logsumexp(-1)
    safe = lse.masked_fill(lse == -math.inf, 0.0)  # a row with no key: output 0, like the CPU kernel
    return ((s - safe[..., None]).exp().to(v.dtype) @ v), lse


def _prefix_then_causal(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float) -> torch.Tensor:
    """An extend of ``n`` rows over ``L - n`` cached keys plus their own: the cached part without a
    mask and the new part as a causal square, merged by their log-sum-exp. One SDPA call with an
    explicit [n, L] mask takes SDPA's masked path, 1.5x slower at 4K new over 4K cached (SGLang's
    chunked prefill makes every long prompt such an extend). qh: [Hq, n, D]; kh, vh: [Hkv, L, D]."""
    p = kh.shape[1] - qh.shape[1]
    o, lse = attend_with_lse(qh[None], kh[None, :, :p], vh[None, :, :p], scale)
    o_new, lse_new = attend_with_lse(qh[None], kh[None, :, p:], vh[None, :, p:], scale, causal=True)
    # softmax over both key sets: o + (o_new - o) * sigmoid(lse_new - lse)
    return o.float().lerp_(o_new.float(), torch.sigmoid(lse_new - lse)[..., None]).to(qh.dtype)[0]


def attention_over_runs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: list[tuple[int, int]],
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """``dense_attention`` for a few query rows over keys that sit in the pool as ascending runs,
    reading each run through a view: no per-layer copy of the whole prefix (what dominates a short
    turn or a decode step over a long cached history). Exact: one softmax over all runs' scores.

    q: [n, Hq, D]; runs: [(first pool slot, length), ...] in position order -> [n, Hq, D].
    """
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    L = sum(length for _, length in runs)
    ct = torch.promote_types(q.dtype, k_cache.dtype)  # a float32 model over a bf16 pool: float32, not bf16
    qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d).to(ct)
    scores = q.new_empty(hkv, g * n, L, dtype=torch.float32)
    pos = 0
    for first, length in runs:
        k = k_cache[first : first + length].transpose(0, 1).to(ct)  # [Hkv, r, D] view (a copy if widened)
        if k.dtype == torch.float32:  # written in place
            torch.bmm(qg, k.transpose(1, 2), out=scores[:, :, pos : pos + length])
        else:  # bmm's out= must match its (half) inputs; softmax in fp32 all the same
            scores[:, :, pos : pos + length] = torch.bmm(qg, k.transpose(1, 2))
        pos += length
    scores.mul_(scale)
    if causal and n > 1:
        row_pos = (L - n + torch.arange(n, device=q.device)).repeat(g)  # [g * n], same order as qg rows
        scores.masked_fill_(torch.arange(L, device=q.device)[None, :] > row_pos[:, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(ct)
    out = torch.zeros(hkv, g * n, d, dtype=ct, device=q.device)
    pos = 0
    for first, length in runs:
        out.baddbmm_(probs[:, :, pos : pos + length], v_cache[first : first + length].transpose(0, 1).to(ct))
        pos += length
    return out.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)


def gathered_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row over gathered keys: q [1, Hq, D], k/v [L, Hkv, D] -> [1, Hq, D].

    Two batched matmuls over the KV heads (GQA groups as rows). SDPA's CPU kernels are slower for a
    single query row; they tile for many."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    ct = torch.promote_types(q.dtype, k.dtype)  # a float32 model over a bf16 pool: float32, not bf16
    k, v = k.to(ct), v.to(ct)
    qg = q.view(hkv, hq // hkv, d).to(ct)
    probs = torch.bmm(qg, k.permute(1, 2, 0)).float().mul_(scale).softmax(dim=-1).to(ct)
    return torch.bmm(probs, v.transpose(0, 1)).reshape(1, hq, d).to(q.dtype)


#: Query rows up to which the run-wise path beats gathering the prefix (short turns). One layer,
#: 9/3 heads, D 64, 4K cached keys in two runs, run-wise / gather + SDPA (2026-11-24): 3 rows 0.69 /
#: 1.58 ms, 16 rows 1.82 / 2.07, 32 rows 4.01 / 3.15, 64 rows 11.8 / 5.2.
RUNS_MAX_ROWS = 16
#: The run-wise path also needs few runs for its rows and long runs: each run costs a few small
#: matmuls (~40 us), a gather ~1 us per key. 4K keys (2026-11-25): 8 rows in 4 runs 1.76 / 2.13 ms, in 16
#: runs 2.34 / 2.08, in 64 runs 4.21 / 2.68; 2-8 rows over 1K keys in 64 runs 2.2-2.7 / 0.45-0.7 (a
#: chunk-pruned history's page cache is such a fragmented set).
RUNS_MAX_WORK = 64
RUNS_MIN_AVG_LEN = 128
#: New rows up to which an extend on CPU takes the native kernel (``extend_attention`` in
#: kernels/paged_decode.cpp): one layer, 9/3 heads, D 64, float32, 2 threads (2026-11-28), native /
#: torch: 16 rows over 416 keys in 16-slot chunks (a chunk-pruned restore) 0.13 / 0.25 ms, 16 over
#: 4K contiguous 1.3 / 3.9 ms (SDPA's masked path), 5 over 100 0.018 / 0.09, 32 over 2K 1.25 / 1.57,
#: 63 over 700 0.84 / 1.03; from 64 rows the log-sum-exp merge of the flash op takes over.
EXTEND_NATIVE_MAX_ROWS = 32
#: Decode without the native kernel: read the pool through run views when a sequence has at most
#: this many slot runs, else gather its KV first. Each run costs two small matmuls (~10-20 us of
#: dispatch on these CPUs) while a gather of a 4K-token prefix costs about as much as reading it
#: twice; the two meet around 8 runs for 0.5-8K-token histories (benchmarks/studies/decode_paths.py).
DECODE_VIEW_MAX_RUNS = 8
#: The native decode kernel's smallest split of one sequence's keys (its flash-decoding work item); a
#: sequence's splits depend only on its own length, so a row's result does not depend on the batch.
DECODE_MIN_SPLIT = 256


class DecodePath(StrEnum):
    """How a decode batch's attention was computed (the plan decides, by a measured rule)."""

    NATIVE = "native"  # the C++ kernel: every sequence in one call, KV read in place once
    VIEWS = "views"  # per sequence, over run views of the pool (few runs: contiguous enough)
    GATHER = "gather"  # per sequence, its KV gathered then two matmuls (fragmented pool)


@EXECUTORS.register("torch")
class TorchDenseExecutor(AttentionExecutor):
    """Dense plans with torch (any device torch runs on); decode batches on CPU with the native
    paged-decode kernel when it could be built (:mod:`sgl_loopkv.kernels.paged_decode`).

    ``decode_paths`` counts decode attention calls (one per layer) by :class:`DecodePath`;
    ``last_decode_path`` is the latest one (the backend reports them)."""

    def __init__(self, native_decode: bool = True):
        self.native = None
        if native_decode:
            from sgl_loopkv.kernels.paged_decode import load

            self.native = load()
        self.decode_paths: Counter[DecodePath] = Counter()
        self.last_decode_path: DecodePath | None = None

    def decode_path(self, plan: AttentionPlan, k_cache: torch.Tensor) -> DecodePath:
        if self.native is not None and k_cache.device.type == "cpu":
            return DecodePath.NATIVE
        few_runs = all(
            (r := plan.runs(i)) is not None and len(r) <= DECODE_VIEW_MAX_RUNS for i in range(plan.batch_size)
        )
        return DecodePath.VIEWS if few_runs else DecodePath.GATHER

    def native_extend(self, plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether a CPU extend of a few rows takes the native kernel: causal, head dim 64 or 128,
        rows of the pool contiguous per head (SGLang's CPU pools are)."""
        return (
            self.native is not None
            and plan.causal
            and k_cache.device.type == "cpu"
            and q.shape[-1] in (64, 128)
            and k_cache.dim() == 3
            and k_cache.stride(2) == 1
            and k_cache.stride(1) == k_cache.shape[2]
            and k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and plan.kv_indices.dtype == torch.int64
        )

    def run(self, plan, q, k_cache, v_cache, scale, out):
        if plan.is_decode and plan.batch_size:
            return self.run_decode(plan, q, k_cache, v_cache, scale, out)
        native = self.native_extend(plan, q, k_cache)
        for i in range(plan.batch_size):
            q0, q1 = plan.qo_indptr[i], plan.qo_indptr[i + 1]
            if q0 == q1:
                continue
            if q1 - q0 == 1:  # a one-row extend is a decode step: same path, same numbers
                one = AttentionPlan([0, 1], [0, plan.kv_len(i)], plan.kv_slots(i), plan.causal)
                self.run_decode(one, q[q0:q1], k_cache, v_cache, scale, out[q0:q1])
                continue
            if q1 - q0 <= EXTEND_NATIVE_MAX_ROWS and native:
                dst = out[q0:q1]
                o = dst if dst.is_contiguous() else torch.empty_like(dst)
                self.native.extend_attention(
                    q[q0:q1].contiguous(), k_cache, v_cache, plan.kv_slots(i).contiguous(), scale, o
                )
                if o is not dst:
                    dst.copy_(o)
                continue
            runs = plan.runs(i) if q1 - q0 <= RUNS_MAX_ROWS else None
            if (
                runs is not None
                and 1 < len(runs)
                and (q1 - q0) * len(runs) <= RUNS_MAX_WORK
                and plan.kv_len(i) >= RUNS_MIN_AVG_LEN * len(runs)
            ):
                out[q0:q1] = attention_over_runs(q[q0:q1], k_cache, v_cache, runs, scale, plan.causal)
            else:
                out[q0:q1] = dense_attention(
                    q[q0:q1], plan.kv_of(i, k_cache), plan.kv_of(i, v_cache), scale, plan.causal
                )
        return out

    def run_decode(self, plan, q, k_cache, v_cache, scale, out):
        path = self.last_decode_path = self.decode_path(plan, k_cache)
        self.decode_paths[path] += 1
        if path is DecodePath.NATIVE:
            o = out if out.is_contiguous() else torch.empty_like(out)
            self.native.paged_decode(
                q.contiguous(), k_cache, v_cache, plan.kv_indices, plan.kv_indptr_tensor, scale, o, DECODE_MIN_SPLIT
            )
            if o is not out:
                out.copy_(o)
            return out
        for i in range(plan.batch_size):
            runs = plan.runs(i) if path is DecodePath.VIEWS else None
            if runs is not None and len(runs) > 1:
                out[i : i + 1] = attention_over_runs(q[i : i + 1], k_cache, v_cache, runs, scale, causal=False)
            else:
                out[i : i + 1] = gathered_decode(q[i : i + 1], plan.kv_of(i, k_cache), plan.kv_of(i, v_cache), scale)
        return out
