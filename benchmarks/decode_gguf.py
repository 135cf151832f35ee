"""What :mod:`benchmarks.decode` measures about the GGUF path beyond its grid cells: the bytes a decode
step reads from the file (its limit row), where a step's time goes, and a server's memory.

Step breakdown (one request at a context ``L``, in this process, the server stopped): ``weights`` = one
decode row through every block matrix of a step as the server holds them
(:func:`sgl_loopkv.models.gguf.weights.decode_step_linears`: per layer qkv, o, gate+up, down, then
the LM head), the kernels the server calls, one after another so each matrix is read cold as in a
served step; ``attention`` = the loopkv dense executor's decode of one query over ``L`` contiguous
keys and values in the served pool's dtype (bfloat16, the GGUF path's default) for each layer, every
layer's keys and values a buffer of its own, read from memory as a served step reads them (one buffer
for every layer stays in cache and times the compute alone), with the file's head geometry; ``other`` = the served
TPOT minus both (norms, rotary, sampling, SGLang's scheduler and streaming, Python). Median of
``repeats`` steps after two warm-ups; torch's threads as in this process (the server uses the
machine's cores as well)."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from benchmarks.harness.stats import median_call_s
from sgl_loopkv.attention.executor import TorchDenseExecutor
from sgl_loopkv.attention.plan import AttentionPlan
from sgl_loopkv.models.gguf.reader import GGUFFile
from sgl_loopkv.models.gguf.weights import decode_step_linears


def file_weight_bytes(path: Path) -> int:
    """Bytes of every tensor in the file, each once (a tied embedding is the LM head, read once a step)."""
    return sum(w.nbytes for w in GGUFFile(path).tensors.values())


def geometry(path: Path) -> dict:
    """Layers and attention heads from the file's metadata."""
    g = GGUFFile(path)
    a = g.architecture
    heads = int(g.metadata(f"{a}.attention.head_count"))
    hidden = int(g.metadata(f"{a}.embedding_length"))
    return {
        "layers": int(g.metadata(f"{a}.block_count")),
        "heads": heads,
        "kv_heads": int(g.metadata(f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(g.metadata(f"{a}.attention.key_length", hidden // heads)),
        "hidden": hidden,
    }


def step_breakdown(
    path: Path, context: int, tpot_ms: float | None, repeats: int = 15, kv_dtype: torch.dtype = torch.bfloat16
) -> dict:
    """ms per decode step: weights, attention, other (served TPOT minus both; None without a TPOT)."""
    geo = geometry(path)
    linears = decode_step_linears(GGUFFile(path))
    x = torch.randn(1, geo["hidden"])

    def weights():
        for lin in linears:  # each matrix takes its own input width (down: the MLP's), values do not matter
            lin(x if lin.in_features == x.shape[1] else torch.randn(1, lin.in_features))

    hq, hkv, d = geo["heads"], geo["kv_heads"], geo["head_dim"]
    kv = [
        (torch.randn(context, hkv, d).to(kv_dtype), torch.randn(context, hkv, d).to(kv_dtype))
        for _ in range(geo["layers"])
    ]
    q, out = torch.randn(1, hq, d), torch.empty(1, hq, d)
    plan = AttentionPlan([0, 1], [0, context], torch.arange(context), causal=True)
    ex = TorchDenseExecutor()

    def attention():
        for k, v in kv:
            ex.run_decode(plan, q, k, v, d**-0.5, out)

    w_ms = 1000 * median_call_s(weights, repeats)
    a_ms = 1000 * median_call_s(attention, repeats)
    return {
        "context": context,
        "tpot_ms": tpot_ms,
        "weights_ms": w_ms,
        "attention_ms": a_ms,
        "other_ms": None if tpot_ms is None else tpot_ms - w_ms - a_ms,
        "weight_bytes": sum(p.nbytes for lin in linears for p in lin.parts),
        "torch_threads": torch.get_num_threads(),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "how": __doc__.split("Step breakdown ")[1].split("\n\n")[0].replace("\n", " "),
    }


def tree_memory_mb(pids: list[int]) -> dict:
    """A server's process tree: summed RSS and PSS (PSS splits shared pages, e.g. a mapped file, among
    the processes that map them), and the largest process's RSS (the scheduler, which holds the weights)."""
    rss = pss = top = 0.0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
        top = max(top, info.rss)
    return {"rss_mb": rss / 2**20, "pss_mb": pss / 2**20, "scheduler_rss_mb": top / 2**20}
