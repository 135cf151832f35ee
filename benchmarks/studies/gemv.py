"""The decode kernels ``gemv_f32`` and ``gemv_bf16`` (``kernels/decode_linear.cpp``) against the
bits of torch's own kernels (MKL for float32, oneDNN for bfloat16).

Two parts per dtype, each against the same code with ``LOOPKV_EXACT_LINEAR=1`` (F.linear's bits,
through the split over torch's threads):

- ``kernel``: in-process, one decode step's linear layers of SmolLM2's geometry (30 x qkv 960x576,
  o 576x576, gate_up 3072x576, down 576x1536, then the 49152x576 LM head; random weights, cold: 540
  MB in float32, 270 MB in bfloat16, more than the caches) for 1-64 rows (a decode batch of that many): the gemv kernel, the split
  and unsplit ``F.linear``, the rounds alternated, medians; plus each kernel's mean absolute error
  against the float64 sum.
- ``fidelity``: two SmolLM2 servers of that dtype, gemv and exact: per prompt (synthetic text of
  200-3000 tokens and three one-line chat prompts), 64 greedy tokens on each (length of the identical
  prefix), then every position of the exact server's continuation as a one-token extend over the
  cached prefix (the one-row path): top-1 agreement and the top token's log-probability gap.

    python -m benchmarks.studies.gemv                    # both parts, both dtypes (~9 min)
    python -m benchmarks.studies.gemv --parts kernel --dtypes bfloat16
    python -m benchmarks.studies.gemv --replot           # table and plot again from gemv.json

Writes benchmarks/results/gemv.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import requests
import torch
import torch.nn.functional as F

from benchmarks.common import synthetic_ids, timed_generate
from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.results import md_table
from benchmarks.studies import RESULTS, write_results
from sgl_loopkv.kernels import decode_linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
ROWS = [1, 2, 4, 8, 16, 24, 32, 64]
CHAT = [
    "Explain why the sky is blue in two sentences.",
    "List three uses of a river bridge.",
    "Write a haiku about winter stations.",
]
GEN = 64


GEMV = {"float32": "gemv_f32", "bfloat16": "gemv_bf16"}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
BUILT = {"float32": "has_gemv", "bfloat16": "has_gemv_bf16"}


def kernel_part(dtype: str, rounds: int, steps: int) -> dict:
    module = decode_linear.load()
    assert module is not None and getattr(module, BUILT[dtype])(), f"{GEMV[dtype]} is not built here"
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    weights = [(torch.randn(*s) * 0.05).to(dt) for _ in range(30) for s in LAYER_SHAPES]
    weights.append((torch.randn(*HEAD) * 0.05).to(dt))
    gemv = getattr(module, GEMV[dtype])
    kernels = {
        "gemv": lambda x, w: gemv(x, w, None),
        "split": lambda x, w: module.decode_linear(x, w, None),
        "F.linear": F.linear,
    }
    out: dict = {"threads": torch.get_num_threads(), "ms": {}, "mean_abs_err": {}}
    for rows in ROWS:
        xs = {k: torch.randn(rows, k).to(dt) for k in (576, 1536)}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(rounds):  # alternated, so that the machine's drift falls on every kernel alike
            for name, fn in kernels.items():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    times[name].append(time.perf_counter() - t0)
        out["ms"][str(rows)] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    for n, k in [*LAYER_SHAPES, HEAD]:
        w = weights[-1] if (n, k) == HEAD else (torch.randn(n, k) * 0.05).to(dt)
        x = torch.randn(1, k).to(dt)
        ref = x.double() @ w.double().T
        out["mean_abs_err"][f"{n}x{k}"] = {
            name: float((fn(x, w).double() - ref).abs().mean()) for name, fn in kernels.items() if name != "split"
        }
    return out


def _top5(url: str, ids: list[int]) -> dict[int, float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    r.raise_for_status()
    return {int(t): lp for lp, t, _ in r.json()["meta_info"]["output_top_logprobs"][0]}


def fidelity_part(dtype: str) -> dict:
    """Servers of ``dtype`` with the gemv kernel and exact (torch's bits); for bfloat16 also an exact
    float32 server, the reference both bf16 servers are held to (two bf16 kernels differ in the
    last bf16 place of a few outputs, and bf16's rounding carries that far: what matters is whether
    gemv_bf16 agrees with float32 less often than oneDNN's bf16 does)."""
    from transformers import AutoTokenizer

    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models.default_model import ensure_default_model
    from sgl_loopkv.server.process import ServerProcess

    tok = AutoTokenizer.from_pretrained(ensure_default_model(LoopKVConfig().resolved_cache_dir))
    prompts = [synthetic_ids(tok, n, seed=s) for n, s in ((200, 1), (600, 2), (1500, 3), (3000, 4))]
    for c in CHAT:
        text = tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    exact = {decode_linear.EXACT_ENV: "1"}
    specs = {"gemv": (dtype, {}), "exact": (dtype, exact)}
    pairs = [("gemv", "exact")]  # (server, reference): the server's top-1 along the reference's greedy tokens
    if dtype != "float32":
        specs["float32"] = ("float32", exact)
        pairs += [("gemv", "float32"), ("exact", "float32")]
    # --loopkv-weights float32: the float32 conversion, what the committed results measured (a plain start
    # serves the GGUF file)
    args = ["--max-total-tokens", "16384", "--loopkv-weights", "float32"]
    servers = {
        name: ServerProcess(["--dtype", dt, *args], env=env, log_path=RESULTS / f"gemv_{dtype}_{name}.log")
        for name, (dt, env) in specs.items()
    }
    rows: dict[str, list] = {f"{a}~{b}": [] for a, b in pairs}
    try:
        for s in servers.values():
            s.start()
        for p in prompts:
            greedy = {k: timed_generate(s.url, p, GEN)["output_ids"] for k, s in servers.items()}
            asked: dict = {}  # (server, reference, position) -> top-5 logprobs: each extend asked once
            for a, b in pairs:
                for name in (a, b):
                    for i in range(GEN):
                        if (name, b, i) not in asked:
                            asked[name, b, i] = _top5(servers[name].url, p + greedy[b][:i])
            for a, b in pairs:
                ref = greedy[b]
                same = next((i for i, (x, y) in enumerate(zip(greedy[a], ref)) if x != y), GEN)
                agree, gaps = 0, []
                for i in range(GEN):
                    ta, tb = asked[a, b, i], asked[b, b, i]
                    best = max(tb, key=tb.get)
                    agree += max(ta, key=ta.get) == best
                    gaps.append(abs(ta[best] - tb[best]) if best in ta else float("inf"))
                rows[f"{a}~{b}"].append(
                    {"prompt_tokens": len(p), "greedy_identical": same, "agree": agree, "gaps": gaps}
                )
    finally:
        for s in servers.values():
            s.stop()
    out = {}
    for pair, rs in rows.items():
        gaps = [g for r in rs for g in r["gaps"]]
        out[pair] = {
            "prompts": rs,
            "top1_agreement": sum(r["agree"] for r in rs) / (GEN * len(rs)),
            "greedy_identical_all": all(r["greedy_identical"] == GEN for r in rs),
            "greedy_identical_prompts": sum(r["greedy_identical"] == GEN for r in rs),
            "max_logprob_gap": max(gaps),
            "median_logprob_gap": statistics.median(gaps),
        }
    return out


def report_md(p: dict) -> str:
    runs = p.get("runs", {})

    def run_of(key: str) -> str:
        r = runs.get(key)
        return f" (run {r['when']}, `python -m benchmarks.studies.gemv {r['args']}`)" if r else ""

    md = [f"# gemv (last run {p['env']['when']}; `python -m benchmarks.studies.gemv {p['args']}`)\n"]
    for dtype, k in p.get("kernel", {}).items():
        name = GEMV[dtype]
        md.append(
            f"\nOne decode step's linear layers, SmolLM2 geometry, cold {dtype} weights, {machine_label()}, "
            f"{k['threads']} torch threads: ms per step, median (rounds alternated){run_of('kernel:' + dtype)}.\n\n"
        )
        rows = [[r, v["gemv"], v["split"], v["F.linear"], v["split"] / v["gemv"]] for r, v in k["ms"].items()]
        md.append(md_table(["rows", f"{name} ms", "split (torch's bits) ms", "F.linear ms", f"split / {name}"], rows))
        md.append(f"\nMean absolute error against the float64 sum, one row, {dtype}:\n\n")
        errs = [[s, v["gemv"], v["F.linear"]] for s, v in k["mean_abs_err"].items()]
        md.append(md_table(["weight", name, "F.linear"], errs))
    if p.get("fidelity"):
        md.append(
            "\nServer fidelity, SmolLM2: each server's top-1 and top-token log-probability along the reference's "
            f"{GEN} greedy tokens (one-token extends over the cached prefix: the one-row path), 7 prompts of 38-3000 "
            "tokens; `exact` = the same server with `LOOPKV_EXACT_LINEAR=1` (torch's bits), `float32` = an exact "
            "float32 server." + "".join(f"\n{d}:{run_of('fidelity:' + d)}." for d in p["fidelity"]) + "\n\n"
        )
        rows = []
        for dtype, comps in p["fidelity"].items():
            for pair, f in comps.items():
                a, b = pair.split("~")
                rows.append([
                    dtype, a, b, f"{f['greedy_identical_prompts']} / {len(f['prompts'])}",
                    statistics.mean(r["greedy_identical"] for r in f["prompts"]),
                    f"{f['top1_agreement']:.4f}", f["max_logprob_gap"], f["median_logprob_gap"],
                ])  # fmt: skip
        md.append(
            md_table(
                [
                    "dtype",
                    "server",
                    "reference",
                    "greedy identical (prompts)",
                    f"identical greedy tokens, mean (of {GEN})",
                    "top-1 agreement",
                    "max gap",
                    "median gap",
                ],  # fmt: skip
                rows,
            )
        )
    md.append("\n![gemv](gemv.png)\n")
    return "".join(md)


def plot(p: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernel, fidelity = p.get("kernel", {}), p.get("fidelity", {})
    n = len(kernel) + bool(fidelity)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.6), squeeze=False)
    for ax, (dtype, k) in zip(axes[0], kernel.items()):
        rows = sorted(int(r) for r in k["ms"])  # each part's own run
        for name in ("gemv", "split", "F.linear"):
            label = GEMV[dtype] if name == "gemv" else name
            ax.plot(rows, [k["ms"][str(r)][name] for r in rows], marker="o", label=label)
        ax.set(xscale="log", xlabel="rows", ylabel="ms per decode step (linears)", title=f"{dtype} linears, cold")
        ax.set_xticks(rows, [str(r) for r in rows])
        ax.legend(fontsize=8)
    if fidelity:
        ax = axes[0][-1]
        for dtype, comps in fidelity.items():
            for pair, f in comps.items():
                gaps = [max(g, 1e-9) for r in f["prompts"] for g in r["gaps"]]  # equal: drawn at 1e-9
                label = f"{SHORT[dtype]} {pair.replace('~', ' vs ')}"
                ax.hist(gaps, bins=[10 ** (e / 4) for e in range(-37, 1)], alpha=0.5, label=label, histtype="step")
        ax.set(xscale="log", xlabel="|top-token logprob gap| vs reference (0 at 1e-9)", ylabel="positions")
        ax.set_title("server fidelity (one-token extends)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "gemv.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["kernel", "fidelity"], choices=["kernel", "fidelity"])
    ap.add_argument("--dtypes", nargs="+", default=list(GEMV), choices=list(GEMV))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--replot", action="store_true", help="table and plot again from gemv.json")
    args = ap.parse_args()
    if args.replot:
        payload = json.loads((RESULTS / "gemv.json").read_text())
        write_results("gemv", payload, report_md(payload))
        plot(payload)
        return
    # a run replaces the parts and dtypes it ran in gemv.json and keeps the others (each with its own run)
    path = RESULTS / "gemv.json"
    payload: dict = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(payload.get("runs"), dict):  # older layout: start over
        payload = {"runs": {}}
    env = environment()
    run = {"when": env["when"], "args": f"--parts {' '.join(args.parts)} --dtypes {' '.join(args.dtypes)}"}
    payload["env"] = env
    payload["args"] = run["args"]
    for part in args.parts:
        for d in args.dtypes:
            got = kernel_part(d, args.rounds, args.steps) if part == "kernel" else fidelity_part(d)
            payload.setdefault(part, {})[d] = got
            payload["runs"][f"{part}:{d}"] = run
    write_results("gemv", payload, report_md(payload))
    plot(payload)
    print(report_md(payload))


if __name__ == "__main__":
    main()
