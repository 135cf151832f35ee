"""What :mod:`benchmarks.decode` measures about the GGUF path beyond its grid cells: the bytes a decode
step reads from the file (its limit row), where a step's time goes, and a server's memory.

Served step breakdown (:func:`served_breakdown`, the one :mod:`benchmarks.decode` reports): a GGUF
server of its own with ``--enable-metrics`` decodes one request over a context of ``L`` tokens; its
``loopkv_decode_seconds{part}`` counters (:mod:`sgl_loopkv.models.step_timing`) split the step, per step:
``weights`` = the block matrices (projections and LM head), ``attention`` = the layers' attention calls,
``other`` = the client's mean inter-token time minus both, itself split into ``layers_other`` (the
layers' norms, rotary embedding, activation and Python) and ``framework`` (SGLang's step around the
forward: scheduling, sampling, streaming, the HTTP stream).

Kernels alone (:func:`step_breakdown`: one request at a context ``L``, in this process, the server
stopped), for comparison with the served parts: ``weights`` = one
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

from benchmarks.common import metrics
from benchmarks.harness.stats import median_call_s
from server.process import ServerProcess
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
        "how": "kernels alone " + __doc__.split("Kernels alone ")[1].split("\n\n")[0].replace("\n", " "),
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


def served_breakdown(path: Path, ids: list[int], gen: int = 64, repeats: int = 3, log: Path | None = None) -> dict:
    """ms per decode step of one request over ``ids`` on a GGUF server with ``--enable-metrics`` (see the
    module docstring): the mean over ``repeats`` streams of ``gen`` tokens, after a fill and a warm-up."""
    from benchmarks.decode import stream_generate, token_intervals

    def seconds(m: dict, part: str) -> float:
        return m.get(f'loopkv_decode_seconds_total{{part="{part}"}}', 0.0)

    args = ["--model-path", str(path), "--enable-metrics", "--max-total-tokens", str(len(ids) + gen + 256)]
    with ServerProcess(args, log_path=log).start() as srv:
        stream_generate(srv.url, ids, 1)
        stream_generate(srv.url, ids, 8)
        before, gaps = metrics(srv.url), []
        for _ in range(repeats):
            gaps += token_intervals([stream_generate(srv.url, ids, gen)["arrivals"]])[0]
        after = metrics(srv.url)
    steps = after.get("loopkv_decode_steps_total", 0.0) - before.get("loopkv_decode_steps_total", 0.0)
    if steps <= 0:
        raise RuntimeError("the server timed no decode step (is the lean forward off?)")
    ms = {
        k: 1000 * (seconds(after, k) - seconds(before, k)) / steps
        for k in ("forward", "weights", "attention", "lm_head")
    }
    step = 1000 * sum(gaps) / len(gaps)
    return {
        "context": len(ids),
        "tpot_ms": step,
        "weights_ms": ms["weights"] + ms["lm_head"],
        "attention_ms": ms["attention"],
        "other_ms": step - ms["weights"] - ms["lm_head"] - ms["attention"],
        "layers_other_ms": ms["forward"] - ms["weights"] - ms["attention"],
        "framework_ms": step - ms["forward"] - ms["lm_head"],
        "lm_head_ms": ms["lm_head"],
        "steps": steps,
        "weight_bytes": sum(p.nbytes for lin in decode_step_linears(GGUFFile(path)) for p in lin.parts),
        "how": "served: " + __doc__.split("Served step breakdown ")[1].split("\n\n")[0].replace("\n", " "),
    }
