"""The backend's sparse-prefill dispatch on fake SGLang batches: no policy is the dense backend,
decode and short extends stay dense, long extends (also after a cached prefix) run the policy's
plan, and the result is the sparse executor's."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_loopkv.attention import dense_attention
from sgl_loopkv.attention.backend import LoopKVAttnBackend
from sgl_loopkv.attention.policies.loopserve import VerticalSlashPolicy
from sgl_loopkv.attention.sparse.torch import sparse_attention
from tests.fakes import FakeKVPool, fake_batch, fake_layer, fake_runner

HQ, HKV, D, POOL = 6, 2, 16, 4096
LAYER = fake_layer(3, HQ, D, 0.25)


class SpyPolicy(VerticalSlashPolicy):
    def __init__(self):
        super().__init__(alpha=0.6, block_size=16)
        self.calls = []

    def select(self, layer_id, q, k, scale):
        self.calls.append((layer_id, q.shape[0], k.shape[0]))
        return super().select(layer_id, q, k, scale)


def backend(policy, min_len=64):
    req_to_token = torch.zeros(4, 1024, dtype=torch.int32)
    req_to_token[0] = torch.arange(1024)
    req_to_token[1] = torch.arange(1024, 2048).flip(0)  # not one run: the plan gathers
    pool = FakeKVPool.random(0, LAYER.layer_id + 1, POOL, HKV, D)  # the test's KV is already in the pool
    return LoopKVAttnBackend(fake_runner(req_to_token, pool), prefill_policy=policy, sparse_min_len=min_len)


def batch(mode, seq_lens, q_lens):
    rows = [0, 1][: len(seq_lens)]
    return fake_batch(mode, rows, seq_lens, q_lens, torch.zeros(sum(q_lens), dtype=torch.int64))


def run(be, fb, seed=1):
    be.init_forward_metadata(fb)
    q = torch.randn(sum(fb.extend_seq_lens_cpu), HQ * D, generator=torch.Generator().manual_seed(seed))
    return q.view(-1, HQ, D), be.forward_extend(q, None, None, LAYER, fb, save_kv_cache=False).view(-1, HQ, D)


def test_without_a_policy_the_backend_is_the_dense_backend():
    be = backend(None)
    q, out = run(be, batch(ForwardMode.EXTEND, [500, 300], [500, 120]))
    assert be.sparse_seqs is None
    pool = be.token_to_kv_pool
    k, v = pool.k[LAYER.layer_id], pool.v[LAYER.layer_id]
    ref0 = dense_attention(q[:500], k[:500], v[:500], 0.25)
    slots = torch.arange(1024, 2048).flip(0)[:300]
    ref1 = dense_attention(q[500:], k[slots], v[slots], 0.25)
    assert torch.equal(out, torch.cat([ref0, ref1]))  # bit for bit: the same calls


def test_long_extends_go_sparse_short_ones_and_decode_stay_dense():
    policy = SpyPolicy()
    be = backend(policy, min_len=100)
    q, out = run(be, batch(ForwardMode.EXTEND, [500, 300], [500, 80]))  # the second: cached prefix, short
    assert be.sparse_seqs == [True, False] and policy.calls == [(3, 500, 500)]
    pool = be.token_to_kv_pool
    k, v = pool.k[LAYER.layer_id], pool.v[LAYER.layer_id]
    mask = VerticalSlashPolicy(alpha=0.6, block_size=16).select(3, q[:500], k[:500], 0.25)
    assert mask.density() < 0.9
    torch.testing.assert_close(out[:500], sparse_attention(q[:500], k[:500], v[:500], mask, 0.25))
    slots = torch.arange(1024, 2048).flip(0)[:300]
    torch.testing.assert_close(out[500:], dense_attention(q[500:], k[slots], v[slots], 0.25))

    policy.calls.clear()
    run(be, batch(ForwardMode.EXTEND, [900, 300], [400, 150]))  # chunked extends after a prefix
    assert sorted(policy.calls) == [(3, 150, 300), (3, 400, 900)]

    be.init_forward_metadata(batch(ForwardMode.DECODE, [501, 301], [1, 1]))
    assert be.sparse_seqs is None


@pytest.mark.parametrize("min_len", [499, 500])
def test_min_len_is_exclusive(min_len):
    be = backend(SpyPolicy(), min_len=min_len)
    be.init_forward_metadata(batch(ForwardMode.EXTEND, [500], [500]))
    assert be.sparse_seqs == ([True] if min_len < 500 else None)
