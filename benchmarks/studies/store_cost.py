"""What a finished turn's store costs the scheduler thread (it runs there after the turn's last token,
and every request behind it waits): the int8 tier's quantization and the key summaries every stored
segment keeps, torch's ops against the native kernels (``kernels/kv_quant.cpp``), for turns of the
default model's KV shape in the plain start's bfloat16 pool, on one thread as the store runs
(``torch_single_threaded``). Medians of 5; the CPU is in the results' env.

    python -m benchmarks.studies.store_cost
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import model_facts
from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.results import md_table
from benchmarks.harness.stats import median
from benchmarks.studies import write_results
from sgl_loopkv.cache.quant import quantize_torch
from sgl_loopkv.kernels import kv_quant
from sgl_loopkv.selection.pages import chunk_minmax_torch

REPEATS = 5


def timed(f, kv: torch.Tensor) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        f(kv)
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = ap.parse_args()
    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import DEFAULT_MODEL_NAME, ensure_default_model

    m = model_facts(ensure_default_model(LoopKVConfig().resolved_cache_dir), DEFAULT_MODEL_NAME)
    native = kv_quant.load()
    assert native is not None, "the kv_quant kernel does not build here"
    torch.set_num_threads(1)
    rows, out = [], []
    for n in args.lengths:
        kv = torch.randn(m.num_layers, 2, n, m.num_kv_heads, m.head_dim).bfloat16()
        r = {
            "tokens": n,
            "quantize_torch_ms": 1e3 * timed(quantize_torch, kv),
            "quantize_native_ms": 1e3 * timed(native.quantize, kv),
            "summaries_torch_ms": 1e3 * timed(lambda x: chunk_minmax_torch(x[:, 0], 16), kv),
            "summaries_native_ms": 1e3 * timed(lambda x: native.chunk_minmax(x[:, 0], 16), kv),
        }
        r["speedup"] = (r["quantize_torch_ms"] + r["summaries_torch_ms"]) / (
            r["quantize_native_ms"] + r["summaries_native_ms"]
        )
        out.append(r)
        rows.append([n, *(round(v, 1) for v in list(r.values())[1:5]), f"{r['speedup']:.1f}x"])
        print(rows[-1], flush=True)
    env = environment()
    md = (
        f"# A finished turn's store: int8 quantization and key summaries (`python -m benchmarks.studies.store_cost`)\n\n"
        f"{m.name}'s KV shape ({m.num_layers} layers, {m.num_kv_heads} KV heads of {m.head_dim}) in a bfloat16 pool, "
        f"one thread, median of {REPEATS}; {env['cpu_model']} ({machine_label(env)}).\n\n"
        + md_table(
            [
                "turn tokens",
                "quantize torch ms",
                "quantize native ms",
                "summaries torch ms",
                "summaries native ms",
                "speed-up",
            ],
            rows,
        )
    )
    summary = {"by_tokens": {str(r["tokens"]): r for r in out}, "speedup_min": min(r["speedup"] for r in out)}
    write_results("store_cost", {"summary": summary, "env": env}, md)
    print(md)


if __name__ == "__main__":
    main()
