"""The process context is set once and read only once set; layer-wise loads wait through the KV
pool's layer transfer counter (SGLang's ``get_key_buffer``), the same for every attention backend."""

from __future__ import annotations

import threading

import pytest
import torch

from sgl_loopkv.cache.importance import ChunkImportance
from sgl_loopkv.cache.loader import LayerwiseLoader, LoadPart
from sgl_loopkv.context import Context, get_context, has_context, reset_context, set_context
from sgl_loopkv.krul.observer import KrulObserver


@pytest.fixture
def fresh_context():
    saved = get_context() if has_context() else None
    reset_context()
    yield
    reset_context()
    if saved is not None:
        set_context(saved)


def test_context_is_read_only_once_set_and_set_only_once(fresh_context):
    with pytest.raises(RuntimeError, match="not set"):
        get_context()
    ctx = Context(importance=ChunkImportance(), observer=KrulObserver())
    set_context(ctx)
    assert get_context() is ctx
    with pytest.raises(RuntimeError, match="already set"):
        set_context(Context(importance=ChunkImportance(), observer=KrulObserver()))
    assert get_context() is ctx


def test_plugin_sets_the_context_once(fresh_context):
    from sgl_loopkv.plugin import _set_context

    _set_context()
    ctx = get_context()
    _set_context()  # register() runs more than once per process: the context stays
    assert get_context() is ctx and not ctx.observer.enabled and ctx.importance.probe_layer is None


def kv_pool(layers=3, slots=64, heads=2, dim=8):
    from sgl_loopkv.platform import activate_cpu_standin, use_cpu_engine

    use_cpu_engine()
    activate_cpu_standin()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(slots, 16, torch.float32, heads, dim, layers, "cpu", False)


def test_a_pool_reader_waits_per_layer_for_the_loader():
    """Any attention backend reads layers through the pool's get_key_buffer/get_value_buffer: with the
    loader registered as the pool's layer transfer counter, a read of layer l returns only once the
    in-flight load wrote layer l, and the load runs on the loader thread (submit does not copy)."""
    pool = kv_pool()
    gate, reached = threading.Event(), threading.Event()

    def on_copy(nbytes, decode_s, copy_s):  # the loader thread holds layer 1 back until the test opens the gate
        if not reached.is_set() and loader._done[0] == 0:
            reached.set()
            gate.wait(10)

    loader = LayerwiseLoader(pool.k_buffer, pool.v_buffer, on_copy=on_copy)
    pool.register_layer_transfer_counter(loader)
    slots = torch.arange(16, 32)
    kv = torch.randn(3, 2, 16, 2, 8)
    loader.submit([LoadPart(kv, slots)])
    assert reached.wait(10)  # layer 0 copied, not yet counted done: submit returned before the copy finished
    got = {}
    reader = threading.Thread(target=lambda: got.update(k=pool.get_key_buffer(2)[slots].clone()))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # the read of layer 2 waits for the load
    gate.set()
    reader.join(10)
    torch.testing.assert_close(got["k"], kv[2, 0])
    torch.testing.assert_close(pool.get_value_buffer(1)[slots], kv[1, 1])
    assert not loader.pending
    loader.close()
