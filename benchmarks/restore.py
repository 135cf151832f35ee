"""Restore benchmark (Krul): TTFT of a returning conversation's turn when its evicted history is
recomputed, loaded whole, partly recomputed with a fixed split, or restored by sgl-loopkv (the
cost-model planner, with cross-layer sharing when it is on); stored bytes per token; fidelity vs
dense; bubble fraction.

Systems (one server per system and history length; a device pool just larger than the history,
so one filler request evicts it to the host tier):
- full_recompute: sgl-loopkv attention, radix cache off (the history is prefilled again);
- full_load: tiered cache, ``--loopkv-restore-planner load_all``, no sharing (exact: the dense
  reference for fidelity);
- fixed: tiered cache, ``--loopkv-restore-planner fixed --loopkv-restore-ratio 0.4`` (Krul's 2:3
  recompute:load, the same front share in every layer);
- loopkv_planner: tiered cache, ``krul`` planner (cost model calibrated on this machine), no sharing;
- loopkv: the same plus compressed storage: cross-layer sharing (minicache codec, selection at its
  defaults) and bf16 tiers.

Fidelity: greedy agreement = fraction of 128 greedy tokens before the first divergence from
full_load; first-token KL(full_load || system) over full_load's top-20 tokens plus the lumped tail.
Bubble fraction = seconds the forward waited for a layer's load (``loopkv_restore_seconds{part=
"bubble"}``) / TTFT of the returning turn. Stored bytes per token = host tier bytes / host tier
tokens (key summaries included for every system).

    python -m benchmarks.restore                 # 2K/4K/8K, 1 repeat
    python -m benchmarks.restore --quick         # 4K only
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.common import RESULTS, environment, md_table, median, synthetic_ids, timed_generate, write_results
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import ensure_default_model
from sgl_loopkv.server.process import ServerProcess

GEN = 128
TOPK = 20
FILLER = 1100
FULL_KV_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2, fp32, per token


def sharing_flags() -> list[str]:
    """Compressed storage: cross-layer sharing (codec from $LOOPKV_BENCH_CODEC, default minicache;
    gamma, r_l and pairing at their defaults) and bf16 tiers."""
    return [
        "--loopkv-share-layers",
        os.environ.get("LOOPKV_BENCH_CODEC", "minicache"),
        "--loopkv-store-dtype",
        "bfloat16",
    ]


def systems() -> dict[str, list[str] | None]:
    out: dict[str, list[str] | None] = {
        "full_recompute": None,
        "full_load": ["--loopkv-restore-planner", "load_all"],
        "fixed": ["--loopkv-restore-planner", "fixed", "--loopkv-restore-ratio", "0.4"],
        "loopkv_planner": ["--loopkv-restore-planner", "krul"],
    }
    out["loopkv"] = ["--loopkv-restore-planner", "krul", *sharing_flags()]
    return out


def turn_ids(tok) -> list[int]:
    return tok("\nUser: Summarise what was said about the river and the museum.\nAssistant:", add_special_tokens=False)[
        "input_ids"
    ]


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("loopkv_") and not line.startswith("#"):
            key, val = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(val)
    return out


def first_token_logprobs(url: str, ids: list[int], token_ids: list[int] | None) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": TOPK,
    }
    if token_ids:
        body["token_ids_logprob"] = token_ids
    r = requests.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    m = r.json()["meta_info"]
    top = {int(t): float(lp) for lp, t, *_ in m["output_top_logprobs"][0]}
    chosen = {int(t): float(lp) for lp, t, *_ in (m.get("output_token_ids_logprobs") or [[]])[0] or []}
    return {"top": top, "chosen": chosen, "cached": m["cached_tokens"]}


def kl_topk(ref: dict[int, float], ours: dict[int, float]) -> float:
    """KL(ref || ours) over ref's top tokens plus one lumped tail bucket."""
    p = {t: math.exp(lp) for t, lp in ref.items()}
    q = {t: math.exp(ours[t]) for t in ref}
    kl = sum(p[t] * (math.log(p[t]) - math.log(max(q[t], 1e-30))) for t in p)
    pt, qt = max(1 - sum(p.values()), 1e-12), max(1 - sum(q.values()), 1e-12)
    return kl + pt * (math.log(pt) - math.log(qt))


def agreement(ours: list[int], ref: list[int]) -> float:
    n = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    return n / len(ref)


def run_system(name: str, flags: list[str] | None, tok, L: int, repeats: int, ref_top: list[int] | None) -> dict:
    hist = synthetic_ids(tok, L, seed=L)
    prompt = hist + turn_ids(tok)
    log = RESULTS / f"restore_{name}_{L}.log"
    if flags is None:
        args = ["--disable-radix-cache", "--max-total-tokens", str(L + 1024)]
    else:
        args = ["--max-total-tokens", str(L + 1024), "--enable-metrics", "--loopkv-host-bytes", str(4 << 30), *flags]
    srv = ServerProcess(args, log_path=log).start()
    try:
        runs = []
        if flags is not None:
            timed_generate(srv.url, hist, 1)  # the earlier turn: now stored
        for r in range(repeats):
            if flags is not None:  # evict the history to the host tier (over 4K it may be two radix nodes)
                timed_generate(
                    srv.url, synthetic_ids(tok, FILLER + (4096 if L > 4096 else 0), seed=10_000 + 100 * L + r), 1
                )
                m0 = metrics(srv.url)
            res = timed_generate(srv.url, prompt, GEN)
            if flags is not None:
                m1 = metrics(srv.url)
                host = res["meta_info"]["cached_tokens_details"]["host"]
                assert host >= L - 16, f"{name}: host resume served {res['meta_info']['cached_tokens_details']}"
                res["bubble_s"] = m1.get('loopkv_restore_seconds_total{part="bubble"}', 0.0) - m0.get(
                    'loopkv_restore_seconds_total{part="bubble"}', 0.0
                )
                res["recompute_fraction"] = m1.get("loopkv_restore_recompute_fraction", 0.0)
                res["front_first"] = m1.get('loopkv_restore_last_front_tokens{layer="first"}', 0.0)
                res["front_last"] = m1.get('loopkv_restore_last_front_tokens{layer="last"}', 0.0)
                res["bytes_per_token"] = m1['loopkv_tier_bytes{tier="host"}'] / max(
                    m1['loopkv_tier_tokens{tier="host"}'], 1
                )
            runs.append(res)
        # First-token distribution on the restored KV (still in the pool: this request hits the device).
        lp = first_token_logprobs(srv.url, prompt, ref_top)
    finally:
        srv.stop()
    out = {
        "ttft_s": median([x["ttft_s"] for x in runs]),
        "output_ids": runs[0]["output_ids"],
        "logprobs": lp,
    }
    for key in ("bubble_s", "recompute_fraction", "front_first", "front_last", "bytes_per_token"):
        if key in runs[0]:
            out[key] = median([x[key] for x in runs])
    if "bubble_s" in out:
        out["bubble_fraction"] = out["bubble_s"] / out["ttft_s"]
    return out


def plot(results: dict, lengths: list[int], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, style in zip(names, ("--s", "-o", "-^", "-D", "-*")):
        ax.plot(lengths, [results[name][L]["ttft_s"] for L in lengths], style, label=name)
    ax.set(xscale="log", yscale="log", xlabel="history tokens", ylabel="returning-turn TTFT (s)")
    ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.set_title("Restoring an evicted conversation (SmolLM2, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4K only")
    args = ap.parse_args()
    lengths = [4096] if args.quick else sorted(args.lengths)
    assert 4096 in lengths, "the summary is at 4K"

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_default_model(LoopKVConfig().resolved_cache_dir))
    load_start = os.getloadavg()
    table = systems()
    names = list(table)
    results: dict = {n: {} for n in names}
    order = ["full_load", *[n for n in names if n != "full_load"]]  # the reference first
    with tqdm(total=len(names) * len(lengths), desc="restore") as bar:
        for L in lengths:
            for name in order:
                bar.set_postfix_str(f"{name} {L}")
                ref = results["full_load"].get(L)
                ref_top = list(ref["logprobs"]["top"]) if ref else None
                results[name][L] = run_system(name, table[name], tok, L, args.repeats, ref_top)
                bar.update()

    for L in lengths:
        ref = results["full_load"][L]
        for name in names:
            r = results[name][L]
            r["greedy_agreement"] = agreement(r["output_ids"], ref["output_ids"])
            ours = {**r["logprobs"]["top"], **r["logprobs"]["chosen"]}
            r["first_token_kl"] = kl_topk(ref["logprobs"]["top"], ours) if name != "full_load" else 0.0
    head = "loopkv"
    h4 = results[head][4096]
    summary = {
        "headline_system": head,
        "ttft_recompute_over_loopkv_4k": results["full_recompute"][4096]["ttft_s"] / h4["ttft_s"],
        "ttft_full_load_over_loopkv_4k": results["full_load"][4096]["ttft_s"] / h4["ttft_s"],
        "ttft_fixed_over_loopkv_4k": results["fixed"][4096]["ttft_s"] / h4["ttft_s"],
        "storage_reduction": FULL_KV_BYTES / median([results[head][L]["bytes_per_token"] for L in lengths]),
        "storage_reduction_vs_full_load_tier": median(
            [results["full_load"][L]["bytes_per_token"] / results[head][L]["bytes_per_token"] for L in lengths]
        ),
        "greedy_agreement": min(results[head][L]["greedy_agreement"] for L in lengths),
        "first_token_kl_max": max(results[head][L]["first_token_kl"] for L in lengths),
        "bubble_fraction": median([results[head][L]["bubble_fraction"] for L in lengths]),
        "exact_without_sharing": all(
            results[n][L]["output_ids"] == results["full_load"][L]["output_ids"]
            for n in ("fixed", "loopkv_planner", "full_recompute")
            for L in lengths
        ),
        "targets": {
            "ttft_recompute_over_loopkv_4k": 5,
            "ttft_full_load_over_loopkv_4k": 2.5,
            "storage_reduction": 3,
            "greedy_agreement": 0.9,
        },
    }
    for n in names:
        for L in lengths:
            results[n][L].pop("output_ids")
    env = environment() | {"loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    payload = {"summary": summary, "systems": results, "flags": table, "lengths": lengths, "env": env}
    rows = []
    for L in lengths:
        for n in names:
            r = results[n][L]
            rows.append(
                [
                    L,
                    n,
                    r["ttft_s"],
                    results["full_recompute"][L]["ttft_s"] / r["ttft_s"],
                    results["full_load"][L]["ttft_s"] / r["ttft_s"],
                    f"{r['front_first']:.0f}..{r['front_last']:.0f}" if "front_first" in r else "-",
                    r.get("bubble_fraction", "-"),
                    r.get("bytes_per_token", "-"),
                    FULL_KV_BYTES / r["bytes_per_token"] if "bytes_per_token" in r else "-",
                    r["greedy_agreement"],
                    r["first_token_kl"],
                ]
            )
    md = (
        f"# restore ({env['when']}; `python -m benchmarks.restore{' --quick' if args.quick else ''}`, "
        f"{args.repeats} repeat(s); load average {load_start[0]:.1f} at start, {env['loadavg_end'][0]:.1f} at end)\n\n"
        "SmolLM2-135M-Instruct, fp32, CPU. Returning turn of a conversation whose history was evicted to the "
        f"host tier; {GEN} greedy tokens. Systems:\n\n"
        + "".join(f"- {n}: `{' '.join(f) if f else '--disable-radix-cache'}`\n" for n, f in table.items())
        + "\n"
        + md_table(
            [
                "history",
                "system",
                "TTFT s",
                "recompute / x",
                "full load / x",
                "front tokens recomputed (layer 0..last)",
                "bubble fraction",
                "stored B/token",
                "reduction vs full KV",
                "greedy agreement",
                "first-token KL",
            ],
            rows,
        )
        + f"\nSummary ({head}): TTFT vs full recompute {summary['ttft_recompute_over_loopkv_4k']:.2f}x at 4K "
        f"(target 5x), vs full load {summary['ttft_full_load_over_loopkv_4k']:.2f}x (target 2.5x); storage "
        f"reduction {summary['storage_reduction']:.2f}x vs full KV (target 3x); greedy agreement "
        f"{summary['greedy_agreement']:.2f} (target 0.9); bubble fraction {summary['bubble_fraction']:.3f}; "
        f"plans without sharing exact: {summary['exact_without_sharing']}.\n\n![restore](restore.png)\n"
    )
    write_results("restore", payload, md)
    plot(results, lengths, names, RESULTS / "restore.png")
    print(md)


if __name__ == "__main__":
    main()
