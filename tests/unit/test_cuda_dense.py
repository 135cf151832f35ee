"""Dense batches of the loopkv backend through SGLang's own backend on CUDA
(sgl_loopkv/attention/cuda_dense.py): which path is chosen, and that a delegate is planned once
per batch, runs every layer of a dense batch over the KV the loopkv backend wrote, and is bypassed
where loopkv's own plans apply (sparse decode). On CPU with a recording delegate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_loopkv.attention.backend import LoopKVAttnBackend
from sgl_loopkv.attention.cuda_dense import dense_choice, sglang_dense_backend
from sgl_loopkv.attention.decode import DECODE_POLICIES, DecodeParams
from tests.fakes import FakeKVPool, fake_batch, fake_layer, fake_runner

HQ, HKV, D, LAYERS = 4, 2, 64, 3


def test_dense_choice():
    assert dense_choice("cpu", {}) == "torch" and dense_choice("cpu", {"LOOPKV_CUDA_DENSE": "flashinfer"}) == "torch"
    assert dense_choice("cuda", {"LOOPKV_CUDA_DENSE": "Triton"}) == "triton"
    assert dense_choice("cuda:0", {"LOOPKV_CUDA_DENSE": "torch"}) == "torch"
    assert dense_choice("cuda", {}) in ("flashinfer", "triton")
    with pytest.raises(ValueError, match="LOOPKV_CUDA_DENSE"):
        dense_choice("cuda", {"LOOPKV_CUDA_DENSE": "cudnn"})
    assert sglang_dense_backend(fake_runner(torch.zeros(1, 1, dtype=torch.int32), None)) is None  # CPU


class RecordingBackend:
    def __init__(self):
        self.planned, self.calls = 0, []

    def init_forward_metadata(self, forward_batch):
        self.planned += 1

    def _run(self, kind, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.calls.append((kind, layer.layer_id, save_kv_cache))
        return torch.full((q.shape[0], HQ * D), float(layer.layer_id))

    def forward_decode(self, *a, **kw):
        return self._run("decode", *a, **kw)

    def forward_extend(self, *a, **kw):
        return self._run("extend", *a, **kw)


def forward(be, mode, seq_lens, q_lens):
    r2t = be.req_to_token_pool.req_to_token
    rows = list(range(len(seq_lens)))
    loc = torch.cat([r2t[r, s - n : s] for r, s, n in zip(rows, seq_lens, q_lens)]).long()
    fb = fake_batch(mode, rows, seq_lens, q_lens, loc)
    fb.rids = [f"r{r}" for r in rows]
    be.init_forward_metadata(fb)
    outs, g = [], torch.Generator().manual_seed(len(seq_lens))
    for layer in range(LAYERS):
        n = sum(q_lens)
        q, k, v = (torch.randn(n, h * D, generator=g) for h in (HQ, HKV, HKV))
        call = be.forward_decode if mode.is_decode() else be.forward_extend
        outs.append(call(q, k.view(n, HKV, D), v.view(n, HKV, D), fake_layer(layer, HQ, D, D**-0.5), fb))
    return outs, loc


def backend(delegate, decode_policy=None):
    r2t = torch.arange(2 * 256, dtype=torch.int32).view(2, 256)
    runner = fake_runner(r2t, FakeKVPool.zeros(LAYERS, 512, HKV, D))
    runner.model_config = SimpleNamespace(num_hidden_layers=LAYERS)
    return LoopKVAttnBackend(runner, decode_policy=decode_policy, dense_delegate=delegate)


def test_a_delegate_is_planned_once_per_batch_and_reads_the_kv_loopkv_wrote():
    rec = RecordingBackend()
    be = backend(rec)
    outs, loc = forward(be, ForwardMode.EXTEND, [40, 30], [40, 30])
    assert rec.planned == 1 and [c[:2] for c in rec.calls] == [("extend", i) for i in range(LAYERS)]
    assert all(save is False for *_, save in rec.calls)  # the KV is written once, by loopkv
    assert all(torch.equal(o, torch.full_like(o, float(i))) for i, o in enumerate(outs))
    assert all(be.token_to_kv_pool.k[layer][loc].abs().sum() > 0 for layer in range(LAYERS))
    forward(be, ForwardMode.DECODE, [41, 31], [1, 1])
    assert rec.planned == 2 and rec.calls[-1][0] == "decode"


def test_sparse_decode_batches_stay_on_loopkv_plans():
    rec = RecordingBackend()
    params = DecodeParams(budget=64, page_size=16, logical_page=16, sink=16, local=16, min_context=64)
    be = backend(rec, DECODE_POLICIES.create("lserve", params))
    forward(be, ForwardMode.DECODE, [200, 30], [1, 1])
    assert be.decode_is_sparse and rec.planned == 0 and rec.calls == []
