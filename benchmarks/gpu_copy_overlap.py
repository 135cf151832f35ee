"""Does a tier thread's host-to-device copy overlap the forward on a CUDA GPU? The layer loader
(``sgl_loopkv/cache/loader.py``) restores a history of ``T`` tokens layer by layer into a bf16 pool
while a stand-in forward (per layer: wait for the layer, then matmuls sized to ``--layer-ms``) runs
on its own stream, as SGLang's forward does. Two ways to copy, same run:

- ``default``: the copies on the loader thread's legacy default stream (what the loader did before
  ``sgl_loopkv/cache/copy_stream.py``): every forward kernel queued after a copy waits for it;
- ``stream``: the copies on the loader's own stream, the forward waiting per layer on its event.

Also timed alone: the forward, and the copies; and both again from pinned host memory (the host
arena is pageable today). Median of ``--reps`` restores each. Writes
``<out>/gpu_copy_overlap.json`` (top-level ``summary``) and ``.md``.

    python -m benchmarks.gpu_copy_overlap [--tokens 4096] [--layer-ms 0.5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sgl_loopkv.cache.copy_stream import CopyStream
from sgl_loopkv.cache.loader import LayerwiseLoader, LoadPart

GEOMETRIES = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}  # (layers, KV heads, head dim)


def restore_once(loader, kv, slots, fwd, weight, matmuls: int, copy: bool, compute: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(fwd):
        if copy:
            loader.submit([LoadPart(kv, slots)])
        x = weight[:2048]  # ~0.1 ms a matmul on an H100: the stand-in forward is GPU-bound
        for layer in range(len(loader.k_buffers)):
            if copy:
                loader.wait_until(layer)
            if compute:
                for _ in range(matmuls):
                    x = (x @ weight).tanh_()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_geometry(name: str, tokens: int, layer_ms: float, reps: int) -> dict:
    L, H, D = GEOMETRIES[name]
    kv = torch.randn(L, 2, tokens, H, D, dtype=torch.bfloat16)  # the host tier's copy (pageable, as it is)
    k = [torch.zeros(tokens + 64, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    v = [torch.zeros(tokens + 64, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    slots = torch.arange(tokens, device="cuda") + 64
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    fwd, loader = torch.cuda.Stream(), LayerwiseLoader(k, v)
    own_stream = loader.copies
    # matmuls per layer for ~layer_ms of forward
    restore_once(loader, kv, slots, fwd, weight, 10, copy=False, compute=True)  # cuBLAS warm-up
    t = restore_once(loader, kv, slots, fwd, weight, 10, copy=False, compute=True)
    matmuls = max(1, round(10 * layer_ms * L / 1000 / t))
    out = {"layers": L, "kv_heads": H, "head_dim": D, "tokens": tokens, "matmuls_per_layer": matmuls}
    cases = {
        "forward_alone": dict(copy=False, compute=True),
        "copies_alone": dict(copy=True, compute=False),
        "default": dict(copy=True, compute=True),
        "stream": dict(copy=True, compute=True),
    }
    pinned = kv.pin_memory()  # what a pinned host arena would hand the loader
    cases |= {"copies_alone_pinned": dict(copy=True, compute=False), "stream_pinned": dict(copy=True, compute=True)}
    for case, kw in cases.items():
        loader.copies = CopyStream("cpu") if case == "default" else own_stream  # "cpu": no stream, no events
        src = pinned if case.endswith("pinned") else kv
        times = [restore_once(loader, src, slots, fwd, weight, matmuls, **kw) for _ in range(reps + 1)][1:]
        out[case + "_ms"] = round(statistics.median(times) * 1000, 2)
        if kw["copy"]:  # every layer arrived intact
            assert all(torch.equal(k[x][64:].cpu(), kv[x, 0]) for x in range(L)), case
    loader.copies = own_stream
    loader.close()
    out["default_over_stream"] = round(out["default_ms"] / out["stream_ms"], 3)
    out["ideal_ms"] = max(out["forward_alone_ms"], out["copies_alone_ms"])
    print(name, json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layer-ms", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    rows = {g: run_geometry(g, args.tokens, args.layer_ms, args.reps) for g in GEOMETRIES}
    summary = {f"default_over_stream_{g}": r["default_over_stream"] for g, r in rows.items()}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args) | {"out": str(args.out)},
           "summary": summary, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_copy_overlap.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"Layer loader restore of {args.tokens} tokens into a bf16 pool beside a stand-in forward (~{args.layer_ms} ms"
        f" per layer), {res['device']}, median of {args.reps} (ms)",
        "",
        "| geometry | forward alone | copies alone | copies on the default stream | copies on their own stream"
        " | default / own | copies alone, pinned host | own stream, pinned host |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g, r in rows.items():
        lines.append(
            f"| {g} ({r['layers']} layers, {r['kv_heads']}x{r['head_dim']}) | {r['forward_alone_ms']} | "
            f"{r['copies_alone_ms']} | {r['default_ms']} | {r['stream_ms']} | {r['default_over_stream']}x | "
            f"{r['copies_alone_pinned_ms']} | {r['stream_pinned_ms']} |"
        )
    (args.out / "gpu_copy_overlap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
