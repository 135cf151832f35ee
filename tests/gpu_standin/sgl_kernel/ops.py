"""Torch implementations behind the stand-in's names, with ``sgl_kernel``'s signatures (out
arguments and in-place updates as the real kernels do). Shapes: ``x`` ``[tokens, hidden]``;
``*_and_mul`` inputs ``[tokens, 2 * d]``; renorm ``probs`` ``[batch, vocab]``."""

import os

import torch
import torch.nn.functional as F


def _trace(name: str) -> None:
    path = os.environ.get("LOOPKV_STANDIN_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} call {name}\n")


def traced(name: str, fn):
    def op(*args, **kwargs):
        _trace(name)
        return fn(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    return op


def placeholder(name: str):
    def op(*args, **kwargs):
        _trace(name)
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this process uses sgl-loopkv's CUDA stand-in for sgl_kernel "
            "(GPU check only). Run with SGLANG_FORCE_FUSED_OP_BACKEND=torch and --sampling-backend pytorch."
        )

    op.__name__ = op.__qualname__ = name
    return op


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (weight.float() + offset)).to(x.dtype)


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _into(out, _rms(input, weight, eps, 0.0))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _into(out, _rms(input, weight, eps, 1.0))


def _fused_add(input, residual, weight, eps, offset):
    """In place, as the kernel: ``residual += input`` (in input's dtype), ``input = norm(residual)``."""
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, offset))


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    _fused_add(input, residual, weight, eps, 0.0)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    _fused_add(input, residual, weight, eps, 1.0)


def _gated(act):
    def op(input, out=None, enable_pdl=None):
        d = input.shape[-1] // 2
        return _into(out, act(input[..., :d].float()).to(input.dtype) * input[..., d:])

    return op


def top_k_renorm_prob(probs, top_k):
    """Keep each row's ``top_k`` largest probabilities (ties at the k-th kept), renormalise."""
    k = torch.as_tensor(top_k, device=probs.device).reshape(-1, 1).expand(probs.shape[0], 1).long()
    kth = probs.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(0, probs.shape[-1] - 1))
    kept = probs.masked_fill(probs < kth, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm_prob(probs, top_p):
    """Keep the smallest set of largest probabilities whose mass reaches ``top_p``, renormalise."""
    p = torch.as_tensor(top_p, device=probs.device, dtype=probs.dtype).reshape(-1, 1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= p  # mass before this one already reaches p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def moe_sum(input, output):
    """``output[t] = sum_k input[t, k]``: ``input`` ``[tokens, topk, hidden]``."""
    output.copy_(input.sum(dim=1))


_TORCH = {
    "rmsnorm": rmsnorm,
    "gemma_rmsnorm": gemma_rmsnorm,
    "fused_add_rmsnorm": fused_add_rmsnorm,
    "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm,
    "silu_and_mul": _gated(F.silu),
    "gelu_and_mul": _gated(F.gelu),
    "gelu_tanh_and_mul": _gated(lambda x: F.gelu(x, approximate="tanh")),
    "top_k_renorm_prob": top_k_renorm_prob,
    "top_p_renorm_prob": top_p_renorm_prob,
    "moe_sum": moe_sum,
}
TORCH_BACKED = {name: traced(name, fn) for name, fn in _TORCH.items()}
