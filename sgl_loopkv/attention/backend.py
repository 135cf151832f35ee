"""SGLang glue: the ``loopkv`` attention backend.

Converts SGLang's ForwardBatch into an :class:`AttentionPlan` once per batch
(``init_forward_metadata``) and lets the chosen executor compute every layer from it. Dense today;
sparse planners replace ``plan_batch`` without touching the executors' contract.

Supports full-attention decoder models (Llama/Qwen2 style): no sliding window, no cross
attention, no logit soft-capping, no speculative decoding. Anything else fails loudly at the first
forward instead of computing something different.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_loopkv.attention.executor import EXECUTORS
from sgl_loopkv.attention.plan import AttentionPlan, build_dense_plan
from sgl_loopkv.cache import loader as cache_loader

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "loopkv"


class LoopKVAttnBackend(AttentionBackend):
    def __init__(self, model_runner: ModelRunner, executor: str = "torch"):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.executor = EXECUTORS.create(executor)
        self.forward_metadata: AttentionPlan | None = None

    # --- planning: once per batch -------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if not (mode.is_decode() or mode.is_context_parallel_extend()):
            raise NotImplementedError(f"the loopkv attention backend does not support forward mode {mode.name}")
        self.forward_metadata = self.plan_batch(forward_batch)

    def plan_batch(self, forward_batch: ForwardBatch) -> AttentionPlan:
        bs = forward_batch.batch_size
        seq_lens = (
            forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        ).tolist()
        req_rows = (
            forward_batch.req_pool_indices_cpu
            if forward_batch.req_pool_indices_cpu is not None
            else forward_batch.req_pool_indices
        ).tolist()
        if forward_batch.forward_mode.is_decode():
            q_lens = [1] * bs
        else:
            q_lens = list(forward_batch.extend_seq_lens_cpu)
        return build_dense_plan(self.req_to_token_pool.req_to_token, req_rows, seq_lens, q_lens)

    # --- execution: every layer ---------------------------------------------------------------
    def _forward(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool):
        if layer.is_cross_attention or (layer.sliding_window_size or -1) > -1 or layer.logit_cap:
            raise NotImplementedError(
                f"layer {layer.layer_id}: the loopkv attention backend supports plain causal self-attention "
                "only (no cross attention, sliding window or logit cap); use --attention-backend torch_native"
            )
        loads = cache_loader.active()
        if loads is not None:  # the tiered cache may still be copying this layer's history in
            loads.wait_layer(layer.layer_id)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        self.executor.run(
            self.forward_metadata,
            q,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            layer.scaling,
            out,
        )
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self):
        return False


def create_loopkv_backend(model_runner: ModelRunner) -> LoopKVAttnBackend:
    """Factory registered with SGLang's ``register_attention_backend``."""
    from sgl_loopkv.config import LoopKVConfig

    return LoopKVAttnBackend(model_runner, executor=LoopKVConfig.from_env().attention_executor)
