"""Contract of the CUDA stand-in for ``sgl_kernel`` (tests/gpu_standin, GPU-check infrastructure):
SGLang's Llama serving path imports under a pretended CUDA device with it, the torch-backed ops
equal a torch reference, and every other name stays absent."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.gpu_standin import STANDIN_DIR
from tests.helpers import run_fresh


def _ops():
    spec = importlib.util.spec_from_file_location("_cuda_standin_ops", STANDIN_DIR / "sgl_kernel" / "ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llama_path_imports_under_cuda_with_the_standin(tmp_path):
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu_standin.probe", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == {}
    assert report["standin"], "sgl_kernel did not resolve to the CUDA stand-in"
    assert "sglang.srt.models.llama" in report["ok"] and "sgl_loopkv.plugin" in report["ok"]
    # the submodules SGLang imports at import time on this path
    assert {"sgl_kernel.utils", "sgl_kernel.kvcacheio", "sgl_kernel.quantization"} <= set(report["standin_modules"])


def test_other_names_are_absent_and_placeholders_raise():
    out = run_fresh(
        f"""
        import json, sys
        sys.path.insert(0, {str(STANDIN_DIR)!r})
        import sgl_kernel
        import sgl_kernel.utils
        from sgl_kernel.kvcacheio import transfer_kv_per_layer
        try:
            from sgl_kernel import apply_rope_with_cos_sin_cache_inplace
            absent = False
        except ImportError:
            absent = True
        try:
            from sgl_kernel.scalar_type import scalar_types
            scalar = True
        except ImportError:
            scalar = False
        try:
            sgl_kernel.int8_scaled_mm(None)
            msg = ""
        except NotImplementedError as e:
            msg = str(e)
        print(json.dumps({{"absent": absent, "scalar": scalar, "msg": msg,
                          "standin": sgl_kernel.IS_SGL_LOOPKV_STANDIN, "pdl": sgl_kernel.utils.is_arch_support_pdl()}}))
        """
    )
    assert out["absent"] and not out["scalar"] and out["standin"] and out["pdl"] is False
    assert "int8_scaled_mm" in out["msg"] and "stand-in" in out["msg"]


def _rms_ref(x, w, eps, offset=0.0):
    return (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + eps).sqrt() * (w.double() + offset)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_equal_a_torch_reference(dtype):
    ops, g = _ops(), torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ops.TORCH_BACKED["rmsnorm"](x, w, 1e-6), _rms_ref(x, w, 1e-6), **tol)
    out = torch.empty_like(x)
    ops.TORCH_BACKED["gemma_rmsnorm"](x, w, 1e-6, out=out)
    torch.testing.assert_close(out, _rms_ref(x, w, 1e-6, 1.0), **tol)
    for name, offset in (("fused_add_rmsnorm", 0.0), ("gemma_fused_add_rmsnorm", 1.0)):
        inp, res = x.clone(), torch.randn(5, 64, generator=g).to(dtype)
        want_res = res + x
        ops.TORCH_BACKED[name](inp, res, w, 1e-6)
        torch.testing.assert_close(res, want_res, **tol)
        torch.testing.assert_close(inp, _rms_ref(want_res, w, 1e-6, offset), **tol)


def test_gated_activations_and_moe_sum_equal_a_torch_reference():
    ops, g = _ops(), torch.Generator().manual_seed(1)
    x = torch.randn(4, 2 * 32, generator=g)
    a, b = x[:, :32], x[:, 32:]
    refs = {
        "silu_and_mul": F.silu(a) * b,
        "gelu_and_mul": F.gelu(a) * b,
        "gelu_tanh_and_mul": F.gelu(a, approximate="tanh") * b,
    }
    for name, want in refs.items():
        torch.testing.assert_close(ops.TORCH_BACKED[name](x), want)
        out = torch.empty(4, 32)
        assert ops.TORCH_BACKED[name](x, out) is out
        torch.testing.assert_close(out, want)
    y, out = torch.randn(3, 2, 8, generator=g), torch.empty(3, 8)
    ops.TORCH_BACKED["moe_sum"](y, out)
    torch.testing.assert_close(out, y[:, 0] + y[:, 1])


def test_renorms_equal_a_sorting_reference():
    ops = _ops()
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1]])
    top_k = ops.TORCH_BACKED["top_k_renorm_prob"](probs, torch.tensor([2, 1]))
    torch.testing.assert_close(top_k, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [0.0, 0.0, 1.0, 0.0]]))
    # 0.4 alone < 0.5 -> add 0.3; row 2: 0.4 then one of the 0.25s reaches 0.6 (both tie: both kept)
    top_p = ops.TORCH_BACKED["top_p_renorm_prob"](probs, torch.tensor([0.5, 0.6]))
    assert top_p[0].tolist() == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7])
    assert top_p[1, 3] == 0 and top_p[1, 2] > 0 and top_p[1].sum() == pytest.approx(1.0)
    # scalar k / p apply to every row; full k / p = 1 keep the distribution
    torch.testing.assert_close(ops.TORCH_BACKED["top_k_renorm_prob"](probs, 4), probs / probs.sum(-1, keepdim=True))
    torch.testing.assert_close(ops.TORCH_BACKED["top_p_renorm_prob"](probs, 1.0), probs / probs.sum(-1, keepdim=True))
