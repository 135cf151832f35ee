"""The plain decode layer (:mod:`sgl_loopkv.attention.plain_decode`): the same pool bytes and attention
bits as SGLang's ``set_kv_buffer`` followed by the backend's executor, and the cases it leaves to them."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

from sgl_loopkv.attention.executor import TorchDenseExecutor
from sgl_loopkv.attention.plain_decode import PlainDecode, plain_native, pool_applies
from sgl_loopkv.attention.plan import AttentionPlan, offsets

HQ, HKV, D, LAYERS, SLOTS = 9, 3, 64, 2, 512


@pytest.fixture(scope="module")
def native():
    ex = TorchDenseExecutor()
    if ex.native is None:
        pytest.skip("no C++ toolchain: the paged decode kernel is unavailable")
    return ex.native


def pool(dtype):
    return MHATokenToKVPool(SLOTS, 16, dtype, HKV, D, LAYERS, "cpu", False)


def layer(layer_id: int):
    return SimpleNamespace(
        layer_id=layer_id, k_scale=None, v_scale=None, tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_same_pool_bytes_and_attention_bits_as_sglang_and_the_executor(native, dtype):
    gen = torch.Generator().manual_seed(7)
    ours, theirs = pool(dtype), pool(dtype)
    lens = [37, 300, 1]  # three sequences of one decode batch, slots scattered over the pool
    perm = torch.randperm(SLOTS - 16, generator=gen) + 16
    slots = [perm[sum(lens[:i]) : sum(lens[: i + 1])] for i in range(len(lens))]
    hist = torch.cat(slots)
    for lid in range(LAYERS):  # the histories, then the same bytes in both pools
        theirs.get_key_buffer(lid)[hist] = torch.randn(len(hist), HKV, D, generator=gen).to(dtype)
        theirs.get_value_buffer(lid)[hist] = theirs.get_key_buffer(lid)[hist].flip(0)
    ours.k_buffer = [b.clone() for b in theirs.k_buffer]
    ours.v_buffer = [b.clone() for b in theirs.v_buffer]
    plan = AttentionPlan([0, 1, 2, 3], offsets(lens), torch.cat(slots), causal=True)
    loc = torch.stack([s[-1] for s in slots])  # each sequence's new token: the last slot of its plan
    ex = TorchDenseExecutor()
    plain = PlainDecode(native, ours, plan, loc.int(), lambda: None)  # an int32 loc is taken as well
    for lid in range(LAYERS):
        q = torch.randn(len(lens), HQ * D, generator=gen)
        k, v = torch.randn(len(lens), HKV * D, generator=gen), torch.randn(len(lens), HKV * D, generator=gen)
        got = plain(layer(lid), q, k, v)
        theirs.set_kv_buffer(layer(lid), KVWriteLoc(loc), k.view(-1, HKV, D), v.view(-1, HKV, D))
        want = torch.empty(len(lens), HQ, D)
        ex.run_decode(plan, q.view(-1, HQ, D), theirs.get_key_buffer(lid), theirs.get_value_buffer(lid), D**-0.5, want)
        assert torch.equal(ours.get_key_buffer(lid), theirs.get_key_buffer(lid))
        assert torch.equal(ours.get_value_buffer(lid), theirs.get_value_buffer(lid))
        assert torch.equal(got, want.view(len(lens), HQ * D))


def test_the_cases_it_leaves_to_the_backend(native):
    p = pool(torch.bfloat16)
    assert pool_applies(p) and plain_native(TorchDenseExecutor(), p) is native

    class Watched(MHATokenToKVPool):  # a pool whose writes someone overrides must see every write
        def set_kv_buffer(self, *args, **kwargs):
            return super().set_kv_buffer(*args, **kwargs)

    assert not pool_applies(Watched(SLOTS, 16, torch.bfloat16, HKV, D, LAYERS, "cpu", False))
    assert plain_native(TorchDenseExecutor(native_decode=False), p) is None
    plan = AttentionPlan([0, 1], [0, 4], torch.arange(16, 20), causal=True)
    plain = PlainDecode(native, p, plan, torch.tensor([19]), lambda: None)
    q, k = torch.randn(1, HQ * D), torch.randn(1, HKV * D)
    assert plain(layer(0), q, k.bfloat16(), k.bfloat16()) is None  # not float32 K/V: SGLang's write casts
    for other in ({"k_scale": 0.5}, {"sliding_window_size": 128}, {"logit_cap": 30.0}, {"is_cross_attention": True}):
        assert plain(SimpleNamespace(**{**vars(layer(0)), **other}), q, k, k) is None, other


def test_plain_native_honours_its_switch(native, monkeypatch):
    monkeypatch.setenv("LOOPKV_PLAIN_DECODE", "0")
    assert plain_native(TorchDenseExecutor(), pool(torch.float32)) is None


def test_a_slot_outside_the_pool_is_a_clear_error(native):
    p = pool(torch.float32)
    k = torch.randn(1, HKV * D)
    with pytest.raises(RuntimeError, match="outside the pool"):
        native.store_kv(k, k, p.get_key_buffer(0), p.get_value_buffer(0), torch.tensor([SLOTS + 16]))
    with pytest.raises(RuntimeError, match="rows of"):
        native.store_kv(torch.randn(1, 5), k, p.get_key_buffer(0), p.get_value_buffer(0), torch.tensor([3]))
