"""SGLang glue: the ``loopkv`` attention backend.

Converts SGLang's ForwardBatch into an :class:`AttentionPlan` once per batch
(``init_forward_metadata``) and lets the chosen executor compute every layer from it.

Sparse prefill (``--loopkv-prefill-policy``): for extends with more than ``--loopkv-prefill-min-len`` new
tokens, each layer asks the selection policy for a mask per sequence and the sparse executor runs
the resulting :class:`SparsePlan`; every other forward (decode, short extends, no policy) takes the
dense path unchanged.

Sparse decode (``--loopkv-decode-policy``): decode batches holding a sequence of at least
``--loopkv-decode-min-context`` tokens run through :class:`SparseDecoder` (per-(layer, KV head) page
plans, :mod:`sgl_loopkv.attention.decode`); shorter sequences of the batch read every key in the
same call.

Supports full-attention decoder models (Llama/Qwen2 style): no sliding window, no cross
attention, no logit soft-capping, no speculative decoding. Anything else fails loudly at the first
forward instead of computing something different.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_loopkv.attention.decode.base import DecodePolicy
from sgl_loopkv.attention.decode.freekv import FreeKVPolicy
from sgl_loopkv.attention.decode.selector import SparseDecoder
from sgl_loopkv.attention.executor import EXECUTORS, DecodePath
from sgl_loopkv.attention.plain_decode import PlainDecode, plain_native
from sgl_loopkv.attention.plan import AttentionPlan, build_dense_plan, offsets
from sgl_loopkv.attention.policies import POLICIES, ModelShape, SelectionPolicy
from sgl_loopkv.attention.sparse_plan import SparsePlan
from sgl_loopkv.context import Context, get_context

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "loopkv"
logger = logging.getLogger(__name__)


class LoopKVAttnBackend(AttentionBackend):
    def __init__(
        self,
        model_runner: ModelRunner,
        executor: str = "torch",
        prefill_policy: SelectionPolicy | None = None,
        sparse_executor: str = "torch",
        sparse_min_len: int = 2048,
        context: Context | None = None,
        decode_policy: DecodePolicy | None = None,
        decode_executor: str = "auto",
        dense_delegate: AttentionBackend | None = None,
    ):
        super().__init__()
        # CUDA: SGLang's own FlashInfer/Triton backend runs the plain dense batches (cuda_dense.py)
        self.dense_delegate = dense_delegate
        self.delegated = False  # this batch: planned by (and run through) the delegate
        self.context = context  # the boards this backend feeds (None: feeds nothing)
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.executor = EXECUTORS.create(executor)
        self.decode_metrics = DecodePathMetrics(model_runner.server_args.enable_metrics)
        self.forward_metadata: AttentionPlan | None = None
        self.policy = prefill_policy
        self.sparse_min_len = sparse_min_len
        self.sparse_executor = None
        if prefill_policy is not None:
            from sgl_loopkv.attention.sparse import SPARSE_EXECUTORS

            self.sparse_executor = SPARSE_EXECUTORS.create(sparse_executor, dense=self.executor)
        self.sparse_seqs: list[bool] | None = None  # this batch: per sequence, does its prefill go sparse?
        self.sparse_prefill_metrics = SparsePrefillMetrics(
            model_runner.server_args.enable_metrics and prefill_policy is not None
        )
        self.sparse_decoder = None
        if decode_policy is not None:
            num_layers = model_runner.model_config.num_hidden_layers
            self.sparse_decoder = SparseDecoder(
                decode_policy, num_layers, getattr(self.executor, "native", None), decode_executor
            )
        self.sparse_decode_metrics = SparseDecodeMetrics(
            model_runner.server_args.enable_metrics and decode_policy is not None
        )
        self.decode_is_sparse = False  # this batch: does the sparse decoder run it?
        self.pruned: list | None = None  # this batch: per sequence, its chunk-pruned restore (or None)
        # freekv decode: a pruned history's periods re-select when the query drifts past tau and
        # recall the new chunks from the tiers (None: decode keeps the prefill's selection)
        self.pruned_recall_tau = decode_policy.p.tau if isinstance(decode_policy, FreeKVPolicy) else None
        # this batch: its layers as two native calls each when nothing watches it (None: forward)
        self.plain_decode: PlainDecode | None = None
        self._plain_native = plain_native(self.executor, self.token_to_kv_pool)

    # --- planning: once per batch -------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if not (mode.is_decode() or mode.is_context_parallel_extend()):
            raise NotImplementedError(f"the loopkv attention backend does not support forward mode {mode.name}")
        self.forward_metadata = self.plan_batch(forward_batch)
        self.plain_decode = None
        self.sparse_seqs = None
        self.decode_is_sparse = False
        self.delegated = False
        self.pruned = self.pruned_restores(forward_batch)
        if self.pruned is not None:  # their kept chunks are their plan; the sparse paths do not apply to the batch
            return
        if self.sparse_decoder is not None and mode.is_decode():
            plan = self.forward_metadata
            ids = forward_batch.rids or plan_rows(forward_batch)
            self.decode_is_sparse = self.sparse_decoder.begin(ids, [plan.kv_slots(i) for i in range(plan.batch_size)])
            if self.decode_is_sparse:
                self.sparse_decode_metrics.publish(self.sparse_decoder)
        if self.policy is not None and not mode.is_decode():
            long = [n > self.sparse_min_len for n in forward_batch.extend_seq_lens_cpu]
            self.sparse_seqs = long if any(long) else None
        self.delegated = self.dense_delegate is not None and not self.decode_is_sparse and self.sparse_seqs is None
        if self.delegated:  # one plan per batch, reused by every layer (SGLang's own planning)
            self.dense_delegate.init_forward_metadata(forward_batch)
        watched = self.context is not None and self.context.observer.enabled
        if (
            self._plain_native is not None
            and mode.is_decode()
            and not (self.decode_is_sparse or self.delegated or watched)
        ):
            self.plain_decode = PlainDecode(
                self._plain_native,
                self.token_to_kv_pool,
                self.forward_metadata,
                forward_batch.out_cache_loc,
                lambda: self.decode_metrics.observe(DecodePath.NATIVE),
            )
        if self.sparse_seqs:  # one line per sparse prefill batch (tests and operators look for it)
            logger.info(
                "loopkv sparse prefill (%s): %d of %d sequences, %d new tokens",
                type(self.policy).__name__,
                sum(long),
                len(long),
                sum(n for n, s in zip(forward_batch.extend_seq_lens_cpu, long) if s),
            )

    def plan_batch(self, forward_batch: ForwardBatch) -> AttentionPlan:
        bs = forward_batch.batch_size
        seq_lens = (
            forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        ).tolist()
        req_rows = plan_rows(forward_batch)
        if forward_batch.forward_mode.is_decode():
            q_lens = [1] * bs
        else:
            q_lens = list(forward_batch.extend_seq_lens_cpu)
        return build_dense_plan(self.req_to_token_pool.req_to_token, req_rows, seq_lens, q_lens)

    def pruned_restores(self, forward_batch: ForwardBatch) -> list | None:
        """Per sequence, the chunk-pruned restore of its history (:mod:`sgl_loopkv.cache.pruned`), or
        None for the batch when no sequence has one."""
        cache = self.context.cache if self.context is not None else None
        if cache is None or not getattr(cache, "pruned", None) or not forward_batch.rids:
            return None
        jobs = [cache.pruned_job(rid) for rid in forward_batch.rids]
        return jobs if any(j is not None for j in jobs) else None

    def pruned_plan(self, layer_id: int, q, scale: float, is_decode: bool) -> AttentionPlan:
        """This layer's plan with each pruned history cut to the chunks its period kept: selected
        here at a period's first layer of a prefill, waited for, then listed instead of the history."""
        base = self.forward_metadata
        slots, lengths = [], []
        for i, job in enumerate(self.pruned):
            seq = base.kv_slots(i)
            if job is None:
                slots.append(seq)
                lengths.append(len(seq))
                continue
            rows = q[base.qo_indptr[i] : base.qo_indptr[i + 1]]
            if not is_decode and job.needs_selection(layer_id):
                job.select(layer_id, rows, scale)
            elif is_decode and self.pruned_recall_tau is not None and layer_id % job.period == 0:
                job.decode_select(layer_id, rows, scale, self.pruned_recall_tau)
            job.wait(layer_id)
            kept = job.kept_slots(layer_id).to(seq.device)
            parts = [seq[: job.start], kept, seq[job.start + job.tokens :]]
            slots.extend(parts)
            lengths.append(sum(len(p) for p in parts))
        return AttentionPlan(base.qo_indptr, offsets(lengths), torch.cat(slots), base.causal)

    # --- execution: every layer ---------------------------------------------------------------
    def _forward(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool):
        if layer.is_cross_attention or (layer.sliding_window_size or -1) > -1 or layer.logit_cap:
            raise NotImplementedError(
                f"layer {layer.layer_id}: the loopkv attention backend supports plain causal self-attention "
                "only (no cross attention, sliding window or logit cap); use --attention-backend torch_native"
            )
        if self.plain_decode is not None and save_kv_cache and (o := self.plain_decode(layer, q, k, v)) is not None:
            return o
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        ctx = self.context if self.pruned is None else None  # a pruned history's unread slots are not KV
        if ctx is not None and ctx.importance.wants(layer.layer_id, forward_batch.forward_mode.is_decode()):
            rows = plan_rows(forward_batch)
            ctx.importance.record(
                self.forward_metadata,
                rows,
                q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                layer.scaling,
            )
        if ctx is not None and ctx.observer.wants(layer.layer_id, self.forward_metadata):  # Krul
            rows = plan_rows(forward_batch)
            qv = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
            ctx.observer.record(layer.layer_id, self.forward_metadata, rows, qv, self.token_to_kv_pool, layer.scaling)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        if self.pruned is not None:
            plan = self.pruned_plan(layer.layer_id, q, layer.scaling, forward_batch.forward_mode.is_decode())
            self.executor.run(
                plan,
                q,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                layer.scaling,
                out,
            )
            return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        if self.decode_is_sparse and forward_batch.forward_mode.is_decode():
            self.sparse_decoder.run(
                layer.layer_id,
                q,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                layer.scaling,
                out,
            )
            if layer.layer_id == 0:
                self.decode_metrics.observe(f"sparse-{type(self.sparse_decoder.policy).__name__}")
            return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        if self.sparse_seqs is not None:
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            plan = self.plan_layer(layer.layer_id, q, k_buf, layer.scaling)
            self.sparse_executor.run(
                plan, q, k_buf, self.token_to_kv_pool.get_value_buffer(layer.layer_id), layer.scaling, out
            )
            if layer.layer_id == 0:
                self.sparse_prefill_metrics.observe(self.sparse_seqs, forward_batch.extend_seq_lens_cpu)
            return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        if self.delegated:  # the KV is in the pool already: the delegate only reads it
            run = (
                self.dense_delegate.forward_decode
                if forward_batch.forward_mode.is_decode()
                else self.dense_delegate.forward_extend
            )
            if layer.layer_id == 0 and forward_batch.forward_mode.is_decode():
                self.decode_metrics.observe(f"sglang-{type(self.dense_delegate).__name__}")
            return run(q, k, v, layer, forward_batch, save_kv_cache=False)
        self.executor.run(
            self.forward_metadata,
            q,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            layer.scaling,
            out,
        )
        if layer.layer_id == 0 and forward_batch.forward_mode.is_decode():
            self.decode_metrics.observe(getattr(self.executor, "last_decode_path", None))
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def plan_layer(self, layer_id: int, q, k_cache, scale: float) -> SparsePlan:
        """This layer's sparse plan: the policy's mask for each long extend, None (dense) for the rest."""
        base = self.forward_metadata
        masks = []
        for i, sparse in enumerate(self.sparse_seqs):
            rows = q[base.qo_indptr[i] : base.qo_indptr[i + 1]]
            masks.append(self.policy.select(layer_id, rows, base.kv_of(i, k_cache), scale) if sparse else None)
        return SparsePlan(base, masks)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self):
        return False


def plan_rows(forward_batch) -> list[int]:
    """The batch's request-pool rows, from the host copy when SGLang made one (no device sync)."""
    rows = forward_batch.req_pool_indices_cpu
    return (rows if rows is not None else forward_batch.req_pool_indices).tolist()


class SparseDecodeMetrics:
    """``/metrics`` of sparse decode (``--enable-metrics``): the fraction of context keys read, page
    selections and FreeKV corrections (correction rate = corrections / selections) and bytes recalled
    from slower tiers, updated at each sparse decode step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._last = (0, 0, 0)
        if not enabled:
            return
        from prometheus_client import Counter, Gauge

        self.fraction = Gauge(
            "loopkv_decode_selected_fraction",
            "Fraction of the context's keys sparse decode read (all sparse steps so far)",
            multiprocess_mode="mostrecent",
        )
        self.selections = Counter("loopkv_decode_selections", "Page selections made by the decode policy")
        self.corrections = Counter("loopkv_decode_corrections", "FreeKV speculative selections corrected")
        self.recalled = Counter("loopkv_decode_recalled_bytes", "Bytes of pages recalled from slower tiers")
        self.steps = Counter("loopkv_decode_sparse_steps", "Decode batches run by the sparse decoder")

    def publish(self, decoder: SparseDecoder) -> None:
        if not self.enabled:
            return
        st, pol = decoder.stats, decoder.policy
        now = (pol.decisions, pol.corrections, st.recalled_bytes)
        self.selections.inc(now[0] - self._last[0])
        self.corrections.inc(now[1] - self._last[1])
        self.recalled.inc(now[2] - self._last[2])
        self.steps.inc()
        self.fraction.set(st.selected_fraction)
        self._last = now


class SparsePrefillMetrics:
    """``/metrics`` of sparse prefill (``--enable-metrics``): prefill batches the sparse executor ran, and
    the new tokens of their sequences that went sparse (counted at the batch's first layer)."""

    def __init__(self, enabled: bool):
        self.batches = self.tokens = None
        if enabled:
            from prometheus_client import Counter

            self.batches = Counter("loopkv_sparse_prefill_batches", "Prefill batches run by the sparse executor")
            self.tokens = Counter("loopkv_sparse_prefill_tokens", "New tokens of the sequences prefilled sparse")

    def observe(self, sparse_seqs: list[bool], extend_lens: list[int]) -> None:
        if self.batches is None:
            return
        self.batches.inc()
        self.tokens.inc(sum(n for n, s in zip(extend_lens, sparse_seqs) if s))


class DecodePathMetrics:
    """Which path decode batches took (``loopkv_decode_batches{path}`` on ``/metrics`` with
    ``--enable-metrics``); the first batch of each path is logged, so a log shows it too."""

    def __init__(self, enabled: bool):
        self.seen: set[str] = set()
        self.counter = None
        if enabled:
            from prometheus_client import Counter

            self.counter = Counter("loopkv_decode_batches", "Decode batches by attention path", ["path"])

    def observe(self, path) -> None:
        if path is None:
            return
        name = str(path)
        if name not in self.seen:
            self.seen.add(name)
            logger.info("loopkv decode path: %s", name)
        if self.counter is not None:
            self.counter.labels(path=name).inc()


def create_loopkv_backend(model_runner: ModelRunner) -> LoopKVAttnBackend:
    """Factory registered with SGLang's ``register_attention_backend``."""
    from pathlib import Path

    from sgl_loopkv.config import LoopKVConfig

    config = LoopKVConfig.from_env()
    from sgl_loopkv import restore
    from sgl_loopkv.attention.cuda_dense import sglang_dense_backend
    from sgl_loopkv.attention.executor import dense_attention

    ctx = get_context()
    # the restorer recomputes front tokens with these layers and this attention
    ctx.layer_stack = lambda: restore.model_stack(model_runner.model, dense_attention)
    policy = None
    if config.sparse.enabled:
        from sglang.srt.runtime_context import get_parallel

        mc, tp = model_runner.model_config, get_parallel().attn_tp_size
        shape = ModelShape(
            name=Path(mc.model_path).name,
            num_layers=mc.num_hidden_layers,
            num_q_heads=mc.get_max_num_attention_heads() // tp,
            num_kv_heads=mc.get_num_kv_heads(tp),
        )
        policy = POLICIES.create(config.sparse.policy, config.sparse, shape)
    ctx.observer.configure(config.sharing.enabled, model_runner.model_config.num_hidden_layers, config.sharing.stride)
    decode_policy = None
    if config.decode.enabled:
        from sgl_loopkv.attention.decode import DECODE_POLICIES, DecodeParams

        decode_policy = DECODE_POLICIES.create(config.decode.policy, DecodeParams.from_config(config.decode))
    return LoopKVAttnBackend(
        model_runner,
        executor=config.attention_executor,
        prefill_policy=policy,
        sparse_executor=config.sparse.executor,
        sparse_min_len=config.sparse.min_len,
        context=ctx,
        decode_policy=decode_policy,
        decode_executor=config.decode.executor,
        dense_delegate=sglang_dense_backend(model_runner),
    )
