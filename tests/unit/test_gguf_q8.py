"""The int8-activation GGUF gemv (``kernels/gguf_q8.cpp``): its activation rounding is bitwise a numpy
port of llama.cpp's quantize_row_q8_0_ref; per block type its products are within float32 rounding of a
float64 product of the same quantized activations and within the (proved) rounding bound of x's
quantization of the float product; every path gives the same bits, in any batch and thread split;
linear() takes it only with ``LOOPKV_GGUF_ACTIVATIONS=q8``."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from sgl_loopkv.kernels import gguf_linear, gguf_q8
from sgl_loopkv.models import default_model_gguf
from sgl_loopkv.models.gguf import GGUFFile
from sgl_loopkv.models.gguf.reader import BlockWeight
from tests.unit.test_gguf_kernels import random_blocks

linear_module = importlib.import_module("sgl_loopkv.models.gguf.linear")  # the package exports linear(), the function

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
OUT = 45  # odd: the thread split and the two-weight-rows-at-a-time pass are uneven
U = 2.0**-24


@pytest.fixture(scope="module")
def q8():
    module = gguf_q8.load()
    if module is None or gguf_linear.load() is None:
        pytest.skip("no C++ toolchain: the GGUF kernels are unavailable")
    return module


def in_features(qtype: T) -> int:
    return 512 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 544  # 17 blocks: an odd last block


def weight(qtype: T, rows: int = OUT) -> BlockWeight:
    k = in_features(qtype)
    blocks = random_blocks(qtype, rows, k, np.random.default_rng(int(qtype)))
    return BlockWeight(f"w.{qtype.name}", qtype, (rows, k), torch.from_numpy(np.ascontiguousarray(blocks)))


def reference_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0_ref in float32 numpy (the gguf package's Q8_0 rounding, d kept as float32)."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (b * inv).astype(np.float32)
    a = np.abs(v)
    q = np.sign(v) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))  # roundf: half away from zero (gguf's np_roundf)
    return q.astype(np.int8).reshape(x.shape), d[..., 0], q.sum(axis=-1).astype(np.int32)


def mins(w: BlockWeight) -> np.ndarray:
    """|the additive term| of each weight (float64 [out, in]): m of Q4_1 / Q5_1, dmin * m of Q4_K / Q5_K, else 0."""
    out, k = w.shape
    raw = w.blocks.numpy()
    if w.qtype in (T.Q4_1, T.Q5_1):
        size = 20 if w.qtype == T.Q4_1 else 24
        m = raw.reshape(out, -1, size)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        return np.repeat(np.abs(m), 32, axis=1)
    if w.qtype in (T.Q4_K, T.Q5_K):
        size = 144 if w.qtype == T.Q4_K else 176
        b = raw.reshape(out, -1, size)
        dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        s = b[..., 4:16].astype(np.int64)
        m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        return np.repeat(np.abs(dmin[..., None] * m).reshape(out, -1), 32, axis=1)
    return np.zeros((out, k))


def test_quantize_is_llama_cpp_rounding(q8):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)) * 3
    x[1, :32] = 0  # an all-zero block: d = 0, q = 0
    x[2, :32] = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 0.49999997, -126.5] * 4)  # d = 1: ties
    x[3, 32:64] *= 1e-3
    q, d, s = reference_q8(x.numpy())
    for path in range(len(q8.paths())):
        got_q, got_d, got_s = q8.quantize_q8(x, path)
        assert np.array_equal(got_q.numpy(), q) and np.array_equal(got_s.numpy(), s), path
        assert np.array_equal(got_d.numpy().view(np.uint32), d.view(np.uint32)), path
    assert q[2, :8].tolist() == [127, 3, -3, 1, -1, 2, 0, -127]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gemv_q8_within_bounds(q8, qtype):
    w = weight(qtype)
    k = w.in_features
    wd = quants.dequantize(w.blocks.numpy(), qtype).reshape(w.shape).astype(np.float64)
    wabs = np.abs(wd) + 2 * mins(w)  # bounds |d q| + |m|, the kernel's two terms per weight
    gen = torch.Generator().manual_seed(int(qtype))
    for rows in (1, 2, 5, 16):
        x = torch.randn(rows, k, generator=gen)
        ys = [q8.gemv_q8(x, w.blocks, int(qtype), None, p) for p in range(len(q8.paths()))]
        for y in ys[1:]:
            assert torch.equal(y, ys[0])  # every path sums in one order
        y = ys[0].double().numpy()
        q, d, _ = reference_q8(x.numpy())
        xq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
        # the same quantized activations: float32 rounding only (K u of the absolute terms, any order)
        assert (np.abs(y - xq @ wd.T) <= k * U * (np.abs(xq) @ wabs.T) + 1e-30).all()
        # the float product: |x - xq| <= d / 2 per element (rounding to the nearest multiple of d)
        half = np.repeat(d.astype(np.float64), 32, axis=1) / 2
        exact = x.double().numpy() @ wd.T
        assert (np.abs(y - exact) <= (half @ np.abs(wd).T) * (1 + 1e-6) + k * U * (np.abs(xq) @ wabs.T)).all()
    bias = torch.randn(OUT, generator=gen)
    assert torch.allclose(q8.gemv_q8(x, w.blocks, int(qtype), bias), ys[0] + bias, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_batch_or_threads(q8, qtype):
    w = weight(qtype)
    x = torch.randn(16, w.in_features, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([q8.gemv_q8(x[i : i + 1], w.blocks, int(qtype), None, 0) for i in range(len(x))])  # portable
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 2, 3, 5, 8, 16):
                for path in range(len(q8.paths())):
                    assert torch.equal(q8.gemv_q8(x[:rows], w.blocks, int(qtype), None, path), alone[:rows]), (n, rows)
    finally:
        torch.set_num_threads(threads)


def test_unsupported_type_is_a_clear_error(q8):
    w = torch.zeros(4, 64 * 2, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="type 1 has no int8-activation kernel"):
        q8.gemv_q8(torch.randn(1, 64), w, int(T.F16))
    assert int(T.F16) not in q8.supported_types() and set(TYPES) == set(q8.supported_types())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8.gemv_q8(torch.randn(1, 48), w, int(T.Q8_0))


@pytest.fixture
def activations(monkeypatch):
    def set_mode(value: str):
        monkeypatch.setenv(linear_module.ACTIVATIONS_ENV, value)
        linear_module.activations.cache_clear()
        linear_module._q8_types.cache_clear()

    yield set_mode
    monkeypatch.delenv(linear_module.ACTIVATIONS_ENV, raising=False)
    linear_module.activations.cache_clear()
    linear_module._q8_types.cache_clear()


def test_linear_routes_by_activations(q8, activations):
    g = gguf_linear.load()
    w, f16 = weight(T.Q4_1), weight(T.F16)
    x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(2))
    big = torch.randn(linear_module.GEMV_MAX_ROWS + 1, w.in_features)
    activations("float32")
    assert linear_module.activations() == "float32"
    assert torch.equal(linear_module.linear(x, w), g.gemv(x, w.blocks, int(T.Q4_1), None, -1))  # today's bits
    activations("q8")
    assert torch.equal(linear_module.linear(x, w), q8.gemv_q8(x, w.blocks, int(T.Q4_1)))
    assert torch.equal(linear_module.linear(x, f16), g.gemv(x, f16.blocks, int(T.F16), None, -1))  # no q8 kernel
    assert torch.equal(
        linear_module.linear(big, w), g.gemm_dequant(big, w.blocks, int(T.Q4_1), None, 512, False)
    )  # prefill
    activations("int4")
    with pytest.raises(ValueError, match="LOOPKV_GGUF_ACTIVATIONS"):
        linear_module.activations()


def test_default_model_layers_close_to_float(q8):
    """SmolLM2's Q4_1 layer and Q8_0 LM head: relative error of a row against the float path, with
    activations of a real hidden state's scale (gaussian here): well under 1% at these sizes."""
    f = GGUFFile(default_model_gguf())
    g = gguf_linear.load()
    for name, rows in (("blk.0.attn_q.weight", None), ("blk.5.ffn_down.weight", None), ("token_embd.weight", 4096)):
        w = f[name]
        if rows:
            w = BlockWeight(w.name, w.qtype, (rows, *w.shape[1:]), w.blocks[:rows])
        x = torch.randn(4, w.in_features, generator=torch.Generator().manual_seed(7))
        y, ref = q8.gemv_q8(x, w.blocks, int(w.qtype)), g.gemv(x, w.blocks, int(w.qtype), None, -1)
        rel = float(((y - ref).norm(dim=1) / ref.norm(dim=1)).max())
        assert rel < 0.02, (name, rel)


def test_the_servers_flag_chooses_the_activations(activations):
    """The plugin hands ``--loopkv-gguf-activations`` to the process (``use_activations``); the variable,
    when set, wins (tests and kernel benchmarks); float32, the exact path, is the config's default."""
    from sgl_loopkv.config import LoopKVConfig

    activations("")  # unset: the server's choice decides
    assert LoopKVConfig().gguf_activations == "float32" and linear_module.activations() == "float32"
    try:
        linear_module.use_activations("q8")
        assert linear_module.activations() == "q8"
        activations("float32")
        assert linear_module.activations() == "float32"
    finally:
        linear_module.use_activations("float32")
    with pytest.raises(ValueError, match="activations"):
        linear_module.use_activations("int4")
    with pytest.raises(ValueError, match="--loopkv-gguf-activations"):
        LoopKVConfig(gguf_activations="int4")
