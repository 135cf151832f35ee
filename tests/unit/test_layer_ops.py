"""The element-wise layer ops (``kernels/layer_ops.cpp``): the rotary embedding bitwise the lean forward's
torch composition (SGLang's order), the norm and SiLU * up within a few float32 roundings of a float64
reference (as close as SGLang's own torch ops are), a row's result the same in any batch (the threaded
split included), and bad input refused with a message."""

from __future__ import annotations

import pytest
import torch

from sgl_loopkv.kernels import layer_ops
from sgl_loopkv.models.lean_forward import _rotate

U = 2.0**-24


@pytest.fixture(scope="module")
def ops():
    module = layer_ops.load()
    if module is None:
        pytest.skip("no C++ toolchain: the layer ops are unavailable")
    return module


def sglang_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward_native's float32 arithmetic."""
    return (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)) * weight


def norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, w = x.double(), weight.double()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def within(ours: torch.Tensor, torchs: torch.Tensor, ref: torch.Tensor, ulps: float = 4) -> None:
    """Ours no further from the float64 reference than torch's float32 result plus a few roundings."""
    err, base = (ours.double() - ref).abs(), (torchs.double() - ref).abs()
    assert bool((err <= base + ulps * U * ref.abs() + 1e-30).all()), float((err - base).max())


@pytest.mark.parametrize("rows", [1, 5, 257])  # 257 x 576: split over threads
def test_the_norm_with_and_without_the_residual_add(ops, rows):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    w, eps = torch.rand(576, generator=g) + 0.5, 1e-5
    within(ops.rms_norm(x, w, eps), sglang_norm(x, w, eps), norm64(x, w, eps))
    out, total = ops.add_rms_norm(x, res, w, eps)
    assert torch.equal(total, x + res)  # the residual stream exactly as torch adds it
    within(out, sglang_norm(x + res, w, eps), norm64(x + res, w, eps))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_the_rotary_embedding_is_bitwise_the_torch_composition(ops, rows, head_dim):
    hq, hkv = 9, 3
    g = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, (hq + 2 * hkv) * head_dim, generator=g)  # v columns after q and k: a row stride
    cos_sin = torch.randn(4096, head_dim, generator=g)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    cos, sin = cos_sin.index_select(0, positions).chunk(2, dim=-1)
    want = _rotate(qkv[:, : (hq + hkv) * head_dim].view(rows, -1, head_dim), cos.unsqueeze(-2), sin.unsqueeze(-2))
    q, k = ops.rope_neox(qkv, positions, cos_sin, hq, hkv, head_dim)
    assert torch.equal(q, want[:, :hq].reshape(rows, -1)) and torch.equal(k, want[:, hq:].reshape(rows, -1))


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_times_up(ops, rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    within(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, ref)


def test_a_rows_result_does_not_depend_on_its_batch(ops):
    g = torch.Generator().manual_seed(7)
    x, res, w = torch.randn(300, 576, generator=g), torch.randn(300, 576, generator=g), torch.rand(576, generator=g)
    batch = ops.add_rms_norm(x, res, w, 1e-5)[0]
    assert all(
        torch.equal(batch[i : i + 1], ops.add_rms_norm(x[i : i + 1], res[i : i + 1], w, 1e-5)[0]) for i in (0, 151, 299)
    )
    gate_up = torch.randn(300, 3072, generator=g)
    assert torch.equal(ops.silu_mul(gate_up)[151:152], ops.silu_mul(gate_up[151:152]))


def test_bad_input_is_refused_with_a_message(ops):
    w = torch.ones(64)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.ones(2, 64, dtype=torch.bfloat16), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.ones(2, 64), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="rotary cache"):
        ops.rope_neox(torch.ones(1, 3 * 64), torch.tensor([10]), torch.ones(8, 64), 1, 1, 64)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(torch.ones(1, 7))
