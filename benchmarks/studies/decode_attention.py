"""The CPU paged-decode kernel's two paths side by side: every KV head of a split at once (what the
server runs for head dims 64 and 128) and one KV head per work item (the earlier path, kept for other
head dims; ``paged_decode_per_head``), over a float32 and a bfloat16 pool.

One request, SmolLM2's geometry (9 query heads on 3 KV heads of 64, 30 layers): per context, the 30
layers' pools are distinct buffers (a decode step reads each layer's KV once, from memory), slots
contiguous as a fresh conversation's are. ``cold`` flushes the caches with a 400 MB write before each
step; ``hot`` runs one layer's pool 30 times (the compute alone). Median of ``--repeats`` steps,
torch's threads as given (the server uses every core), the two paths alternating.
``--against REV`` adds the every-head path as it was at git revision REV (built from that
revision's ``kernels/paged_decode.cpp`` as a module of its own), alternating with the others.

    python -m benchmarks.studies.decode_attention                  # ~2 minutes on 2 cores
    python -m benchmarks.studies.decode_attention --against HEAD~1  # and the kernel before a change
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.harness.env import environment, finish
from benchmarks.harness.results import md_table
from benchmarks.studies import RESULTS, write_results

LAYERS, HQ, HKV, D = 30, 9, 3, 64
PATHS = ("per_head", "heads")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step_ms(module, path: str, layers, q, idx, indptr, repeats: int, flush: torch.Tensor | None) -> float:
    fn = module.paged_decode_per_head if path == "per_head" else module.paged_decode
    out = torch.empty_like(q)
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1.0)
        t = time.perf_counter()
        for k, v in layers:
            fn(q, k, v, idx, indptr, D**-0.5, out, 256)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def kernel_at(rev: str):
    """The paged-decode kernel as it was at git revision ``rev``, built as a module of its own."""
    from torch.utils.cpp_extension import load as load_extension

    from sgl_loopkv.kernels.native import CFLAGS, LDFLAGS

    root = Path(__file__).resolve().parents[2]

    def show(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True, text=True
        ).stdout

    out = Path(tempfile.mkdtemp(prefix="paged-decode-against-"))
    (out / "paged_decode_against.cpp").write_text(show("kernels/paged_decode.cpp"))
    headers = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "kernels/"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split()
    for h in (h for h in headers if h.endswith(".h")):  # the revision's own shared headers, beside it
        (out / Path(h).name).write_text(show(h))
    return load_extension(
        name="loopkv_paged_decode_against", sources=[str(out / "paged_decode_against.cpp")], build_directory=str(out),
        extra_cflags=list(CFLAGS), extra_ldflags=LDFLAGS,
    )  # fmt: skip


def run(contexts: list[int], repeats: int, against: str | None = None) -> list[dict]:
    from sgl_loopkv.kernels.paged_decode import load

    module = load()
    if module is None:
        raise SystemExit("the paged-decode kernel did not build here")
    paths = {p: module for p in PATHS}
    if against:
        paths["against"] = kernel_at(against)
    flush = torch.empty(100 * 2**20)  # 400 MB
    rows = []
    cases = [(L, dt, mode) for L in contexts for dt in DTYPES for mode in ("cold", "hot")]
    for L, dt, mode in tqdm(cases, desc="decode attention"):
        pool = L + 64
        layers = [
            (torch.randn(pool, HKV, D).to(DTYPES[dt]), torch.randn(pool, HKV, D).to(DTYPES[dt])) for _ in range(LAYERS)
        ]
        if mode == "hot":
            layers = [layers[0]] * LAYERS
        q = torch.randn(1, HQ, D)
        idx, indptr = torch.arange(32, 32 + L), torch.tensor([0, L])
        ms = {p: [] for p in paths}
        for _ in range(3):  # alternate the paths: drift in the machine's load hits both
            for p, m in paths.items():
                ms[p].append(step_ms(m, p, layers, q, idx, indptr, repeats, flush if mode == "cold" else None))
        kv_bytes = 2 * LAYERS * L * HKV * D * layers[0][0].element_size()
        row = {"context": L, "dtype": dt, "mode": mode, "kv_mb": kv_bytes / 1e6}
        for p in paths:
            row[f"{p}_ms"] = statistics.median(ms[p])
            row[f"{p}_gb_s"] = kv_bytes / row[f"{p}_ms"] / 1e6
        row["per_head_over_heads"] = row["per_head_ms"] / row["heads_ms"]
        if against:
            row["against_over_heads"] = row["against_ms"] / row["heads_ms"]
        rows.append(row)
        del layers
    return rows


def report(payload: dict) -> str:
    env, against = payload["environment"], payload.get("against")
    head = ["context", "KV dtype", "caches", "KV MB", "per-head ms", "every-head ms", "per-head / every-head",
            "every-head GB/s"]  # fmt: skip
    if against:
        head += [f"every-head at {against} ms", f"at {against} / now"]
    rows = []
    for r in payload["rows"]:
        row = [r["context"], r["dtype"], r["mode"], f"{r['kv_mb']:.0f}", f"{r['per_head_ms']:.2f}", f"{r['heads_ms']:.2f}",
               f"{r['per_head_over_heads']:.2f}x", f"{r['heads_gb_s']:.1f}"]  # fmt: skip
        if against:
            row += [f"{r['against_ms']:.2f}", f"{r['against_over_heads']:.2f}x"]
        rows.append(row)
    s = payload["summary"]
    md = (
        f"# decode_attention ({env['when']}; {env['cpu_model']}, {env['cpu_count']} cores, "
        f"{payload['threads']} torch threads)\n\n"
        "One decode step's attention over SmolLM2's 30 layers (9 query heads on 3 KV heads of 64), one "
        "request; ms are medians (see the module docstring).\n\n"
        + md_table(head, rows)
        + f"\nPer-head / every-head, cold, 4K: float32 **{s['cold_4k_float32']:.2f}x**, bfloat16 "
        f"**{s['cold_4k_bfloat16']:.2f}x**; every-head bfloat16 / float32 pool, cold 4K: "
        f"**{s['heads_bf16_over_fp32_cold_4k']:.2f}x** the time.\n"
    )
    if against:
        md += (
            f"\nThe every-head path at `{against}` over now, cold, bfloat16: 4K "
            f"**{s['against_over_heads_cold_4k_bfloat16']:.2f}x**, longest context "
            f"**{s['against_over_heads_cold_longest_bfloat16']:.2f}x**; float32 4K "
            f"**{s['against_over_heads_cold_4k_float32']:.2f}x**.\n"
        )
    return md


def summarize(rows: list[dict]) -> dict:
    by = {(r["context"], r["dtype"], r["mode"]): r for r in rows}
    L = min({r["context"] for r in rows}, key=lambda c: abs(c - 4096))
    out = {
        "cold_4k_float32": by[(L, "float32", "cold")]["per_head_over_heads"],
        "cold_4k_bfloat16": by[(L, "bfloat16", "cold")]["per_head_over_heads"],
        "hot_4k_bfloat16": by[(L, "bfloat16", "hot")]["per_head_over_heads"],
        "heads_bf16_over_fp32_cold_4k": by[(L, "bfloat16", "cold")]["heads_ms"]
        / by[(L, "float32", "cold")]["heads_ms"],
    }
    if "against_over_heads" in rows[0]:
        longest = max(r["context"] for r in rows)
        for dt in DTYPES:
            out[f"against_over_heads_cold_4k_{dt}"] = by[(L, dt, "cold")]["against_over_heads"]
            out[f"against_over_heads_cold_longest_{dt}"] = by[(longest, dt, "cold")]["against_over_heads"]
            out[f"against_over_heads_hot_4k_{dt}"] = by[(L, dt, "hot")]["against_over_heads"]
    return out


def plot(rows: list[dict], path, against: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cold = [r for r in rows if r["mode"] == "cold"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [f"{r['context'] // 1024}K {r['dtype'][:4]}" for r in cold]
    x = range(len(cold))
    bars = [("per_head_ms", "one KV head per item"), ("heads_ms", "every KV head per item")]
    if against:
        bars.append(("against_ms", f"every KV head per item, at {against}"))
    w = 0.8 / len(bars)
    for b, (key, label) in enumerate(bars):
        ax.bar([i + (b - (len(bars) - 1) / 2) * w for i in x], [r[key] for r in cold], width=w, label=label)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step (30 layers)")
    ax.set_title("paged decode attention, one request, caches cold")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--repeats", type=int, default=5, help="steps per timing (default 5)")
    ap.add_argument("--against", metavar="REV", help="also the every-head path at this git revision (default: none)")
    args = ap.parse_args()
    env = environment()
    against = (
        args.against
        and subprocess.run(
            ["git", "rev-parse", "--short", args.against], check=True, capture_output=True, text=True
        ).stdout.strip()
    )  # a commit, not a name that moves
    rows = run(args.contexts, args.repeats, against)
    payload = {"rows": rows, "threads": torch.get_num_threads(), "against": against, "environment": finish(env)}
    payload["summary"] = summarize(rows)
    md = report(payload)
    write_results("decode_attention", payload, md + "\n![decode_attention](decode_attention.png)\n")
    plot(rows, RESULTS / "decode_attention.png", against)
    print(md)


if __name__ == "__main__":
    main()
