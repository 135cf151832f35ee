"""GGUF block kernels (``kernels/gguf_linear.cpp``) against float32 torch on SmolLM2-135M's linear shapes.

Per shape (``[out, in]``: q/o 576x576, gate/up 1536x576, down 576x1536, the tied LM head 49152x576) and
rows of x, the median time of one call with cold weights (each call reads another copy; the copies of
a case total ``--working-set`` MB, several times the last-level cache):

- ``fp32 F.linear``: torch's float32 linear (MKL) on the dequantized weight, what stock SGLang runs;
- ``fp32 loopkv``: the float32 path sgl-loopkv serves today (``kernels/decode_linear.py``);
- ``Q4_1 gemv`` / ``Q8_0 gemv``: the block kernel streaming the weight from its blocks (the best instruction
  set built here; ``Q4_1 gemv avx2``: the same bits through the 8-lane path, on a CPU with AVX-512);
- ``Q4_1 gemv q8`` / ``Q8_0 gemv q8``: ``kernels/gguf_q8.cpp``, x quantized to int8 blocks and integer block
  dots (``LOOPKV_GGUF_ACTIVATIONS=q8``; absent where it did not build);
- ``Q4_1 tiles``: the prefill path (weight tiles dequantized to float32, torch's GEMM), at 32+ rows.

Each has its bandwidth limit: the weight's bytes over the read bandwidth measured here (a float32
sum over a buffer of the working set's size). The ``prefill`` part times 16-64 rows
(gemv against dequantized tiles against float32, without the LM head; a quarter of the repeats), which sets ``GEMV_MAX_ROWS``.

    python -m benchmarks.gguf_kernels            # both parts (~1-2 min)
    python -m benchmarks.gguf_kernels --parts gemv --repeats 15

Writes benchmarks/results/gguf_kernels.{json,md} (``gguf_kernels_<n>t`` with ``--threads n`` > 1). The result names the CPU (model and SIMD flags) and
the load average: on a shared machine the medians move with the load.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.results import RESULTS, md_table, write_results
from benchmarks.harness.stats import median
from sgl_loopkv.kernels import decode_linear, gguf_linear, gguf_q8

SHAPES = {
    "q/o 576x576": (576, 576),
    "gate/up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
    "head 49152x576": (49152, 576),
}
#: The prefill part leaves out the LM head: it multiplies only the rows that sample, not a prompt's.
PREFILL_SHAPES = {k: v for k, v in SHAPES.items() if not k.startswith("head")}
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def cpu_facts() -> dict:
    model, flags = "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return {"model": model, "flags": [f for f in FLAGS if f in flags], "loadavg": list(os.getloadavg())}


def random_blocks(qtype: T, out: int, inp: int) -> torch.Tensor:
    """uint8 [out, row bytes] of random blocks with small finite f16 scales (speed does not depend on values)."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = torch.randint(0, 256, (out, inp // block, size), dtype=torch.uint8)
    scales = torch.full((out, inp // block, 2), 0.01, dtype=torch.float16).view(torch.uint8)
    b[..., : 4 if qtype == T.Q4_1 else 2] = scales[..., : 4 if qtype == T.Q4_1 else 2]
    return b.reshape(out, -1).contiguous()


def copies(make, out: int, inp: int, nbytes: int, working_set: int) -> list:
    return [make(out, inp) for _ in range(max(2, -(-working_set // nbytes)))]


def time_calls(fn, ws: list, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(median, min) ms of one call, each on the next copy of the weight (cold in cache)."""
    fn(x, ws[0]), fn(x, ws[1])
    times = []
    for i in range(max(repeats, min(len(ws), 8 * repeats))):  # small weights: more (short) calls
        w = ws[i % len(ws)]
        t0 = time.perf_counter()
        fn(x, w)
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times), min(times)


def bandwidth_gbs(working_set: int) -> float:
    buf = torch.ones(working_set // 4)
    buf.sum()
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return working_set / min(times) / 1e9  # the fastest pass: the least disturbed by other processes


def systems(module):
    gemv = lambda t, path=-1: lambda x, w: module.gemv(x, w, int(t), None, path)  # noqa: E731
    q8 = gguf_q8.load()
    gemv_q8 = lambda t: lambda x, w: q8.gemv_q8(x, w, int(t), None, -1)  # noqa: E731
    return {
        "fp32 F.linear": (lambda out, inp: torch.randn(out, inp), lambda x, w: F.linear(x, w), 4.0),
        "fp32 loopkv": (lambda out, inp: torch.randn(out, inp), decode_linear.linear, 4.0),
        "Q4_1 gemv": (lambda out, inp: random_blocks(T.Q4_1, out, inp), gemv(T.Q4_1), 20 / 32),
        "Q8_0 gemv": (lambda out, inp: random_blocks(T.Q8_0, out, inp), gemv(T.Q8_0), 34 / 32),
        # the same bits through the 8-lane path, where the build also has the 16-lane one
        "Q4_1 gemv avx2": (lambda out, inp: random_blocks(T.Q4_1, out, inp), gemv(T.Q4_1, 1), 20 / 32),
        "Q4_1 gemv q8": (lambda out, inp: random_blocks(T.Q4_1, out, inp), gemv_q8(T.Q4_1), 20 / 32),
        "Q8_0 gemv q8": (lambda out, inp: random_blocks(T.Q8_0, out, inp), gemv_q8(T.Q8_0), 34 / 32),
        "Q4_1 tiles": (
            lambda out, inp: random_blocks(T.Q4_1, out, inp),
            lambda x, w: module.gemm_dequant(x, w, int(T.Q4_1), None, 512, False),
            20 / 32,
        ),
    }


def run_part(module, shapes, rows_list, names, repeats, args, bw) -> list[dict]:
    cells = []
    for label, (out, inp) in shapes.items():
        for name in names:
            make, fn, bytes_per = systems(module)[name]
            nbytes = int(out * inp * bytes_per)
            ws = copies(make, out, inp, nbytes, args.working_set << 20)
            for rows in rows_list:
                x = torch.randn(rows, inp)
                ms, fastest = time_calls(fn, ws, x, repeats)
                limit = nbytes / (bw * 1e9) * 1e3
                cells.append(
                    {"shape": label, "rows": rows, "system": name, "ms": ms, "min_ms": fastest, "limit_ms": limit}
                )
                print(f"{label:18s} {rows:4d} rows {name:14s} {ms:8.3f} ms (min {fastest:.3f}, limit {limit:.3f})")
            del ws
    return cells


def summarize(res: dict) -> dict:
    """Per shape at one row (a decode step): float32 F.linear / Q4_1 gemv, the 8-lane path / the best
    path where both ran, and the float-activation gemv / the int8-activation one (> 1: the block kernel,
    the wider path, the int8 one is faster); medians."""
    by = {(c["shape"], c["rows"], c["system"]): c["ms"] for c in res["parts"].get("gemv", [])}
    out: dict = {"fp32_over_q4_1_gemv_1row": {}, "avx2_over_best_q4_1_1row": {}, "float_over_q8_q4_1_1row": {}}
    for shape in SHAPES:
        f, q, a = (by.get((shape, 1, n)) for n in ("fp32 F.linear", "Q4_1 gemv", "Q4_1 gemv avx2"))
        i8 = by.get((shape, 1, "Q4_1 gemv q8"))
        key = shape.split()[0]
        if f and q:
            out["fp32_over_q4_1_gemv_1row"][key] = f / q
        if q and i8:
            out["float_over_q8_q4_1_1row"][key] = q / i8
        if a and q:
            out["avx2_over_best_q4_1_1row"][key] = a / q
    return out


def markdown(res: dict) -> str:
    cpu = res["cpu"]
    lines = [
        "# GGUF block kernels vs float32 on SmolLM2-135M's linear shapes",
        "",
        f"{res['machine']}: {cpu['model']}, flags {' '.join(cpu['flags'])}; load average at start "
        f"{cpu['loadavg'][0]:.1f}; {res['env']['torch_threads']} torch threads; gemv = the build's best path "
        f"({(res.get('paths') or ['avx2'])[-1]}); read bandwidth "
        f"{res['bandwidth_gbs']:.1f} GB/s (one thread, fastest of 9 passes); median (min) of at least "
        f"{res['repeats']} calls, cold weights; limit = weight bytes / bandwidth (on a loaded machine the "
        "probe reads slower than an undisturbed stream, and a kernel can beat its limit). "
        f"`python -m benchmarks.gguf_kernels` ({res['env']['when']}).",
    ]
    for part, title in (
        ("gemv", "Decode rows (ms per call)"),
        ("prefill", "Many rows: gemv vs dequantized tiles (ms)"),
    ):
        cells = res["parts"].get(part)
        if not cells:
            continue
        names = list(dict.fromkeys(c["system"] for c in cells))
        keys = list(dict.fromkeys((c["shape"], c["rows"]) for c in cells))
        by = {(c["shape"], c["rows"], c["system"]): c for c in cells}
        header = ["shape", "rows", *names, *(f"{n} limit" for n in names if part == "gemv")]
        rows = []
        for shape, r in keys:
            row = [shape, r, *(f"{by[(shape, r, n)]['ms']:.3g} ({by[(shape, r, n)]['min_ms']:.3g})" for n in names)]
            if part == "gemv":
                row += [by[(shape, r, n)]["limit_ms"] for n in names]
            rows.append(row)
        lines += ["", f"## {title}", "", md_table(header, rows)]
    sm = res.get("summary") or {}
    for key, what in (("fp32_over_q4_1_gemv_1row", "float32 F.linear / Q4_1 gemv"),
                      ("avx2_over_best_q4_1_1row", "Q4_1 gemv, AVX2 path / best path"),
                      ("float_over_q8_q4_1_1row", "Q4_1 gemv on float32 activations / on int8 ones (q8)")):  # fmt: skip
        if sm.get(key):
            lines += ["", f"{what}, one row: " + ", ".join(f"{k} {v:.2f}x" for k, v in sm[key].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["gemv", "prefill"], choices=["gemv", "prefill"])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--working-set", type=int, default=128, help="MB of weight copies per case")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a thread team on an oversubscribed machine waits "
        "for its slowest, descheduled member, and a call's time measures the scheduler)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name = "gguf_kernels" if args.threads == 1 else f"gguf_kernels_{args.threads}t"
    module = gguf_linear.load()
    if module is None:
        raise SystemExit("the GGUF kernels did not build here (see the warning above)")
    bw = bandwidth_gbs(args.working_set << 20)
    res = {"machine": machine_label(), "cpu": cpu_facts(), "env": environment(), "bandwidth_gbs": bw}
    res |= {"repeats": args.repeats, "working_set_mb": args.working_set, "paths": module.paths(), "parts": {}}
    if "gemv" in args.parts:
        names = ["fp32 F.linear", "fp32 loopkv", "Q4_1 gemv", "Q8_0 gemv"]
        names += ["Q4_1 gemv avx2"] if "avx512" in module.paths() else []
        names += ["Q4_1 gemv q8", "Q8_0 gemv q8"] if gguf_q8.load() is not None else []
        res["parts"]["gemv"] = run_part(module, SHAPES, [1, 8], names, args.repeats, args, bw)
        write_results(name, res, markdown(res))
    if "prefill" in args.parts:
        names = ["fp32 F.linear", "Q4_1 gemv", "Q4_1 tiles"]
        res["parts"]["prefill"] = run_part(
            module, PREFILL_SHAPES, [16, 32, 64], names, max(3, args.repeats // 4), args, bw
        )
    res["summary"] = summarize(res)
    json_path, md_path = write_results(name, res, markdown(res))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    RESULTS.mkdir(parents=True, exist_ok=True)
    main()
