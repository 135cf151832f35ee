"""FreeKV decode of a returning conversation from the host tier (issue 14): TTFT, TPOT, device-pool
tokens, bytes recalled and fidelity when a stored history is loaded whole into the device pool
(today's path) or kept in the host tier with only a bounded page cache of its chunks on the device
(``--loopkv-prefix-budget B``), decoding with the prefill's selection or re-selecting and recalling
chunks as the query drifts (``--loopkv-decode-policy freekv``).

Systems (SmolLM2-135M-Instruct, fp32 KV pool, ``--loopkv-restore-planner load_all`` everywhere,
the server flags and helpers of benchmarks/reprefill.py):
- ``load_all``: budget 1.0, dense decode: the whole history is loaded into the device pool; one
  server per history length, a device pool of L + 1024 tokens so a filler request evicts the
  history to the host arena before each resume; its first request (nothing cached) is the
  full-prefill reference;
- ``pruned_b{B}_dense``: ``--loopkv-prefix-budget B``, dense decode: the chunks the turn's prefill
  selected (per period of layers) are the request's KV for the whole answer, nothing recalled;
- ``pruned_b{B}_freekv``: the same with ``--loopkv-decode-policy freekv``: at each period's first
  layer of a decode step, a query whose cosine similarity to the one the period last chose with is
  below ``--loopkv-decode-tau`` (0.9) re-selects the period's chunks; the new ones are recalled
  from the host tier into the page cache (used from the next step on);
- ``stream_b1_freekv``: budget 1.0 with ``--loopkv-prefix-stream`` and freekv: every chunk, restored
  period by period; must decode exactly as the full prefill (``exact_at_full_budget``).
B in 0.25 and 0.5 (0.5: the re-prefill benchmark's recommended budget). The pruned servers serve
every length from one stored history (prefilled, then evicted to the host arena, as
benchmarks/reprefill.py's ``pruned`` does for the host tier); a pruned history never goes back to
the device tree, so every request on it restores again.

Per system and length: one untimed resume (warm-up) and ``--repeats`` timed ones, each with a
different one-sentence turn (each resume restores exactly the history) and ``--gen`` (64) greedy
tokens: TTFT and TPOT (median), device-pool tokens held for the history (pruned: the request's
``cached_tokens_details.pruned.device_tokens``, its page cache; load_all: the history), bytes
recalled during decode (``/metrics`` ``loopkv_prefix_bytes_total{part="recalled"}`` delta) per
decode step and per resume, decode re-selections (the request's ``decode_selections``; correction
rate = re-selections / (decode steps x periods)).

Fidelity vs the full prefill, through the decode path: the reference is load_all's greedy 128
tokens after history + turn B with nothing cached; each system then answers history + turn B
with the reference's tokens forced one decode step at a time (a custom logit processor adds
``Forced.BIAS`` to the reference token; the model's own top-1 is read from the top-2 log-
probabilities of the biased step), so every step decodes over that system's KV (re-selections
and recalls included): teacher-forced top-1 agreement over 128 tokens. The streamed full-budget
server also answers greedily: ``greedy_identical`` to the reference.

Small pool (8000-token history, ``--max-total-tokens 4096``, history on the disk tier): a load_all
server and a ``pruned_b0.5_freekv`` one are asked to resume it; what each answers is recorded from
its own response and log.

    python -m benchmarks.studies.freekv_resume              # 4096 + 8000, B 0.25/0.5, 3 repeats, small pool (~18 min)
    python -m benchmarks.studies.freekv_resume --quick      # 4096, 1 repeat, no small pool -> freekv_resume_quick.*
    python -m benchmarks.studies.freekv_resume --replot     # table and plot again from freekv_resume.json

Run it alone (``flock /tmp/loopkv_cpu.lock python -m benchmarks.studies.freekv_resume``).
Writes benchmarks/results/freekv_resume.{json,md,png} (server logs: benchmarks/results/freekv_resume_*.log).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks import common
from benchmarks.common import metrics, timed_generate
from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.results import md_table
from benchmarks.harness.stats import median
from benchmarks.reprefill import (
    CHUNK,
    COMMON,
    PREFIX,
    Bench,
    _f,
    metrics_after,
    resume_record,
    served,
    turn_b,
    turn_ttft,
)
from benchmarks.studies import RESULTS, write_results
from sgl_loopkv.attention.decode.config import SparseDecodeConfig
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import DEFAULT_MODEL_NAME, ensure_default_model
from sgl_loopkv.server.process import ServerProcess

LENGTHS = [4096, 8000]
BUDGETS = [0.25, 0.5]
GEN = 64  # timed resumes
FID = 128  # teacher-forced and greedy tokens
SMALL_POOL = 4096
TAU = SparseDecodeConfig().tau
RECALLED = 'loopkv_prefix_bytes_total{part="recalled"}'
LOADED = 'loopkv_prefix_bytes_total{part="loaded"}'


class Forced:
    """SGLang custom logit processor: adds BIAS to the reference token of each step (``custom_params``
    ``ref``; the step is the request's output length), so greedy decoding emits the reference while
    the other tokens keep their order: the best of them, in the returned top-2, tells the model's own
    top-1 (``BIAS + its log-probability > 0``: it beat the reference). Serialized by value (dill)."""

    BIAS = 1000.0

    def __call__(self, logits, custom_param_list=None):
        for i, p in enumerate(custom_param_list or []):
            ref, step = p["ref"], len(p["__req__"].output_ids)
            if step < len(ref):
                logits[i, ref[step]] += self.BIAS
        return logits


def forced_processor() -> str:
    import dill

    return json.dumps({"callable": dill.dumps(Forced, byref=False, recurse=True).hex()})


def teacher_forced_decode(url: str, prompt: list[int], ref: list[int]) -> dict:
    """The server's own top-1 at each of ``ref``'s positions, each predicted by a decode step over
    the KV the previous forced steps left (the first by the prompt's prefill)."""
    body = {
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": len(ref),
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"ref": ref},
        },
        "custom_logit_processor": forced_processor(),
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    r = requests.post(f"{url}/generate", json=body, timeout=900)
    r.raise_for_status()
    out = r.json()
    own = []
    for want, top in zip(ref, out["meta_info"]["output_top_logprobs"]):
        others = [e for e in top if int(e[1]) != want]
        beat = others and others[0][0] is not None and others[0][0] + Forced.BIAS > 0
        own.append(int(others[0][1]) if beat else want)
    return {
        "agreement": sum(a == b for a, b in zip(own, ref)) / len(ref),
        "forced_ok": out["output_ids"] == ref,
        "own_top1": own,
        "pruned": out["meta_info"]["cached_tokens_details"].get("pruned"),
    }


class ResumeBench(Bench):
    """benchmarks.reprefill's Bench (history, filler eviction, disk seed clones), with servers
    named for this benchmark and resumes that decode."""

    def __init__(self, args, tok, model, token_bytes: int, root: Path, bar):
        super().__init__(args, tok, model, token_bytes, root, bar)
        self.res: dict = {}
        self.seed = root / "seed"  # the disk tier the first pruned server writes through to (small pool)
        self.n_periods = math.ceil(model.num_layers / PREFIX.period)

    def server(self, name: str, flags: list[str], pool: int) -> ServerProcess:
        args = [*COMMON, "--enable-custom-logit-processor", "--max-total-tokens", str(pool), *flags]
        return ServerProcess(args, log_path=RESULTS / f"freekv_resume_{name}.log").start()

    def resumes(self, url: str, L: int, tier: str, evict: bool) -> list[dict]:
        """Warm-up + timed resumes of the L-token history, ``GEN`` greedy tokens each."""
        runs, hist = [], self.hist(L)
        for r in range(self.args.repeats + 1):
            if evict:
                self.evict(url, L)
            m0 = metrics(url)
            res = timed_generate(url, hist + turn_ttft(self.tok, r), self.args.gen)
            m1 = metrics_after(url, m0, None if evict else LOADED)
            rec = resume_record(res, m0, m1, L, self.token_bytes)
            assert served(res, tier) >= L - CHUNK, f"resume of {L} tokens served {rec['served']}"
            rec["tpot_s"] = (res["total_s"] - res["ttft_s"]) / (res["tokens"] - 1)
            rec["tokens"] = res["tokens"]
            rec["recalled_bytes"] = m1.get(RECALLED, 0.0) - m0.get(RECALLED, 0.0)
            if r:
                runs.append(rec)
        return runs

    def summarise(self, runs: list[dict], L: int, fid: dict) -> dict:
        steps = runs[0]["tokens"] - 1  # decode steps after the prefill's token
        pruned = [x["pruned_details"] for x in runs if x["pruned_details"]]
        sel = [p["decode_selections"] for p in pruned]
        out = {
            "ttft_s": median([x["ttft_s"] for x in runs]),
            "tpot_s": median([x["tpot_s"] for x in runs]),
            "ttfts_s": [x["ttft_s"] for x in runs],
            "tpots_s": [x["tpot_s"] for x in runs],
            "device_pool_tokens": median([p["device_tokens"] for p in pruned]) if pruned else L,
            "history_tokens": L,
            "decode_steps": steps,
            "recalled_bytes": median([x["recalled_bytes"] for x in runs]),
            "recalled_bytes_per_step": median([x["recalled_bytes"] for x in runs]) / steps,
            "bytes_loaded_at_prefill": (
                median([x["loaded_bytes"] - x["recalled_bytes"] for x in runs]) if pruned else L * self.token_bytes
            ),
            "decode_selections": median(sel) if sel else None,
            "correction_rate": median(sel) / (steps * self.n_periods) if sel else None,
            "teacher_forced_agreement": fid["agreement"],
            "forced_ok": fid["forced_ok"],
            "runs": runs,
        }
        if fid.get("pruned"):
            out["teacher_forced_request_pruned"] = fid["pruned"]
        return out

    def reference(self, url: str, L: int) -> None:
        """Greedy ``FID`` tokens after history + turn B, nothing cached: the full-prefill reference."""
        self.ref[L] = {"output_ids": timed_generate(url, self.hist(L) + turn_b(self.tok), FID)["output_ids"]}

    def load_all(self, L: int) -> None:
        self.bar.set_postfix_str(f"load_all {L}")
        srv = self.server(f"load_all_{L}", [], L + 1024)
        try:
            self.reference(srv.url, L)
            runs = self.resumes(srv.url, L, "host", evict=True)
            self.evict(srv.url, L)
            fid = teacher_forced_decode(srv.url, self.hist(L) + turn_b(self.tok), self.ref[L]["output_ids"])
        finally:
            srv.stop()
        self.res.setdefault("load_all", {})[L] = self.summarise(runs, L, fid) | {"startup_s": srv.startup_s}
        self.bar.update()

    def pruned(self, name: str, flags: list[str], lengths: list[int], seed: bool = False) -> None:
        """One server for every length; the history stored once, then evicted to the host arena."""
        self.bar.set_postfix_str(name)
        if seed:  # also written through to a disk directory the small-pool servers clone
            flags = [*flags, "--loopkv-tier-disk-dir", str(self.seed)]
        srv = self.server(name, flags, max(lengths) + 1024)
        full = "--loopkv-prefix-stream" in flags
        try:
            timed_generate(srv.url, self.hist_all[: max(lengths)], 1)
            self.evict(srv.url, max(lengths))
            for L in lengths:
                self.bar.set_postfix_str(f"{name} {L}")
                runs = self.resumes(srv.url, L, "host", evict=False)
                assert all(x["served"]["device"] == 0 and x["pruned_details"] for x in runs), f"{name} {L}: {runs}"
                prompt = self.hist(L) + turn_b(self.tok)
                fid = teacher_forced_decode(srv.url, prompt, self.ref[L]["output_ids"])
                out = self.summarise(runs, L, fid) | {"startup_s": srv.startup_s, "flags": flags}
                if full:  # greedy on the streamed restore (its turn B chunks, stored by the forced request, are exact)
                    out["greedy_identical"] = (
                        timed_generate(srv.url, prompt, FID)["output_ids"] == self.ref[L]["output_ids"]
                    )
                self.res.setdefault(name, {})[L] = out
                self.bar.update()
        finally:
            srv.stop()
        log = (RESULTS / f"freekv_resume_{name}.log").read_text(errors="replace")
        want = len(lengths) * (self.args.repeats + 2 + full)
        assert log.count("tokens chunk-pruned") >= want, f"{name}: fewer chunk-pruned resumes logged than {want}"

    def small_pool(self, budget: float) -> dict:
        """An 8000-token history on the disk tier, a device pool of SMALL_POOL tokens: what a load_all
        and a pruned freekv server answer (from their responses and logs)."""
        L, out = max(LENGTHS), {"history_tokens": max(LENGTHS), "max_total_tokens": SMALL_POOL}
        systems = {
            "load_all": [],
            f"pruned_b{budget:g}_freekv": ["--loopkv-prefix-budget", str(budget), "--loopkv-decode-policy", "freekv"],
        }
        for name, extra in systems.items():
            self.bar.set_postfix_str(f"small pool {name}")
            flags, _ = self.tier_flags("disk", f"small_{name}")
            srv = self.server(f"small_{name}", [*flags, *extra], SMALL_POOL)
            body = {
                "input_ids": self.hist(L) + turn_ttft(self.tok, 0),
                "sampling_params": {"max_new_tokens": self.args.gen, "temperature": 0, "ignore_eos": True},
            }
            try:
                r = requests.post(f"{srv.url}/generate", json=body, timeout=300)
            finally:
                srv.stop()
            rec: dict = {"http_status": r.status_code, "flags": extra}
            if r.ok:
                m = r.json()["meta_info"]
                rec |= {
                    "output_tokens": len(r.json()["output_ids"]),
                    "cached_tokens_details": m["cached_tokens_details"],
                }
            else:
                rec["response"] = r.text[:400]
            log = (RESULTS / f"freekv_resume_small_{name}.log").read_text(errors="replace").splitlines()
            rec["log_lines"] = [
                x[-300:] for x in log if any(w in x for w in ("exceeds", "Error", "error", "resuming"))
            ][:6]
            out[name] = rec
            self.bar.update()
        return out


# --- summary, report, plot -----------------------------------------------------------------------------
def configs(p: dict) -> list[str]:
    return [c for c in p["systems"] if c != "load_all"]


def budget_of(c: str) -> float:
    return 1.0 if c.startswith("stream") else float(c.split("_b")[1].split("_")[0])


def summarize(p: dict) -> dict:
    s, lengths = p["systems"], list(map(str, p["config"]["lengths"]))
    la = s["load_all"]
    free = [c for c in configs(p) if c.startswith("pruned") and c.endswith("freekv")]
    dense = [c for c in configs(p) if c.endswith("_dense")]
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    full = [r for r in s.get("stream_b1_freekv", {}).values()]

    def by_length(systems: list[str], fn) -> dict:
        """{length: {budget: fn(system's cell, load_all's cell)}}"""
        return {L: {f"{budget_of(c):g}": fn(s[c][L], la[L]) for c in systems if L in s[c]} for L in lengths if L in la}

    return {
        "device_pool_tokens": {c: {L: r["device_pool_tokens"] for L, r in v.items()} for c, v in s.items()},
        "device_pool_share_of_history": {
            c: {L: r["device_pool_tokens"] / r["history_tokens"] for L, r in v.items()} for c, v in s.items()
        },
        "recalled_bytes_per_step": {
            f"{budget_of(c):g}": {L: r["recalled_bytes_per_step"] for L, r in s[c].items()} for c in free
        },  # fmt: skip
        "recalled_bytes_per_resume": {
            f"{budget_of(c):g}": {L: r["recalled_bytes"] for L, r in s[c].items()} for c in free
        },  # fmt: skip
        "correction_rate": {f"{budget_of(c):g}": {L: r["correction_rate"] for L, r in s[c].items()} for c in free},
        "ttft_load_all_over_freekv": by_length(free, lambda r, b: ratio(b["ttft_s"], r["ttft_s"])),
        "ttft_load_all_over_pruned_dense": by_length(dense, lambda r, b: ratio(b["ttft_s"], r["ttft_s"])),
        "tpot_ratio_freekv_over_load_all": by_length(free, lambda r, b: ratio(r["tpot_s"], b["tpot_s"])),
        "tpot_ratio_pruned_dense_over_load_all": by_length(dense, lambda r, b: ratio(r["tpot_s"], b["tpot_s"])),
        "ttft_load_all_over_stream_full": {
            L: ratio(la[L]["ttft_s"], r["ttft_s"]) for L, r in s.get("stream_b1_freekv", {}).items() if L in la
        },
        "teacher_forced_agreement": {c: {L: r["teacher_forced_agreement"] for L, r in v.items()} for c, v in s.items()},
        "exact_at_full_budget": bool(full)
        and all(r["teacher_forced_agreement"] == 1.0 and r.get("greedy_identical") for r in full),
        "small_pool": {
            k: v.get("http_status") if isinstance(v, dict) else v for k, v in (p.get("small_pool") or {}).items()
        },
    }


def report_md(p: dict) -> str:
    s, sm, cfg, env = p["systems"], p["summary"], p["config"], p["env"]
    la = s["load_all"]
    lines = [
        f"# freekv resume from the host tier ({env['when']}; `{cfg['command']}`; {machine_label()}; load average "
        f"{env['loadavg_start'][0]:.1f} at start, {env['loadavg_end'][0]:.1f} at end; median of {cfg['repeats']} "
        "timed resume(s) after a warm-up)",
        "",
        f"{cfg['model']} ({cfg['num_layers']} layers), {cfg['pool_dtype']} KV pool. A returning turn (one sentence, "
        f"{cfg['gen']} greedy tokens) after a history stored in the host arena. `load_all`: today's path (budget 1.0, "
        "the whole history loaded into the device pool, dense decode); `pruned_bB_dense`: `--loopkv-prefix-budget B`, "
        "decode over the prefill's selection; `pruned_bB_freekv`: the same with `--loopkv-decode-policy freekv` "
        f"(tau {TAU}: re-selection and recall from the host tier); `stream_b1_freekv`: budget 1.0 streamed "
        f"(`--loopkv-prefix-stream`) with freekv. Period {PREFIX.period} layers ({cfg['n_periods']} periods), "
        f"{PREFIX.local} local chunks.",
        "",
    ]
    rows = []
    for L in map(str, cfg["lengths"]):
        for c in ["load_all", *configs(p)]:
            r = s[c].get(L)
            if r is None:
                continue
            base = la.get(L) or {}
            rows.append(
                [
                    L,
                    c,
                    f"{budget_of(c) if c != 'load_all' else 1.0:g}",
                    r["ttft_s"],
                    _f(base.get("ttft_s") / r["ttft_s"]) if base else "-",
                    r["tpot_s"] * 1e3,
                    _f(r["tpot_s"] / base["tpot_s"]) if base else "-",
                    1 / r["tpot_s"],
                    int(r["device_pool_tokens"]),
                    _f(r["device_pool_tokens"] / r["history_tokens"]),
                    _f(r["bytes_loaded_at_prefill"] / 2**20),
                    _f(r["recalled_bytes_per_step"] / 2**20),
                    _f(r["recalled_bytes"] / 2**20),
                    _f(r["decode_selections"]) if r["decode_selections"] is not None else "-",
                    _f(r["correction_rate"]) if r["correction_rate"] is not None else "-",
                    _f(r["teacher_forced_agreement"]),
                    str(r.get("greedy_identical", "-")),
                ]
            )
    lines.append(
        md_table(
            [
                "history",
                "system",
                "budget",
                "TTFT s (median)",
                "TTFT load_all / x",
                "TPOT ms (median)",
                "TPOT x / load_all",
                "tok/s",
                "device-pool tokens for the history",
                "share of history",
                "MiB loaded at prefill",
                "MiB recalled / decode step",
                "MiB recalled / resume",
                "decode re-selections",
                "correction rate",
                f"teacher-forced top-1 ({FID}, decode)",
                f"greedy {FID} identical",
            ],
            rows,
        )
    )
    lines.append(
        f"\nDecode steps per resume: {cfg['gen'] - 1}; correction rate = re-selections / (decode steps x periods). "
        'Recalled bytes: `/metrics` `loopkv_prefix_bytes_total{part="recalled"}` per resume. Teacher-forced: each '
        "of the reference's tokens forced at its decode step (custom logit processor), the system's own top-1 "
        "compared; the reference is load_all's greedy answer with nothing cached (full prefill)."
    )
    small = p.get("small_pool")
    if small:
        lines += ["", f"## Small pool: {small['history_tokens']}-token history on disk, `--max-total-tokens "
                  f"{small['max_total_tokens']}`", ""]  # fmt: skip
        body = []
        for name, r in small.items():
            if isinstance(r, dict):
                what = r.get("response") or f"{r.get('output_tokens')} tokens, cached {r.get('cached_tokens_details')}"
                body.append([name, " ".join(r["flags"]) or "(defaults)", r["http_status"], what.replace("|", "/")])
        lines.append(md_table(["system", "flags", "HTTP status", "the server's answer"], body))
    lines += [
        "",
        "## Summary",
        "",
        "```json",
        json.dumps(sm, indent=1),
        "```",
        "",
        "![freekv resume](freekv_resume.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(p: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, lengths = p["systems"], list(map(str, p["config"]["lengths"]))
    names = ["load_all", *configs(p)]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    width = 0.8 / len(names)
    panels = [
        ("TTFT load_all / system (higher: faster)", lambda r, b: b["ttft_s"] / r["ttft_s"]),
        ("TPOT system / load_all (lower: faster)", lambda r, b: r["tpot_s"] / b["tpot_s"]),
        ("device-pool tokens / history", lambda r, b: r["device_pool_tokens"] / r["history_tokens"]),
        (f"teacher-forced top-1 ({FID}, decode)", lambda r, b: r["teacher_forced_agreement"]),
    ]
    for ax, (title, fn) in zip(axes, panels):
        for i, c in enumerate(names):
            xs = [j + i * width for j, L in enumerate(lengths) if L in s[c] and L in s["load_all"]]
            ys = [fn(s[c][L], s["load_all"][L]) for L in lengths if L in s[c] and L in s["load_all"]]
            ax.bar(xs, ys, width, label=c, color=f"C{i}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"history {L}" for L in lengths])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.suptitle("Returning conversation decoding from the host tier: load_all vs chunk-pruned (+ freekv recall)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def save(name: str, payload: dict, load_start) -> None:
    payload["summary"] = summarize(payload)
    payload["env"] = environment() | {"loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    write_results(name, payload, report_md(payload))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--budgets", type=float, nargs="+", default=BUDGETS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen", type=int, default=GEN, help="greedy tokens of a timed resume")
    ap.add_argument("--no-small-pool", action="store_true", help="skip the small-pool servers")
    ap.add_argument("--quick", action="store_true", help="4096 only, 1 repeat, no small pool (-> freekv_resume_quick)")
    ap.add_argument("--name", default=None, help="results name (default freekv_resume, _quick with --quick)")
    ap.add_argument("--replot", action="store_true", help="table and plot again from <name>.json")
    args = ap.parse_args()
    name = args.name or ("freekv_resume_quick" if args.quick else "freekv_resume")
    if args.replot:
        return finish(name, json.loads((RESULTS / f"{name}.json").read_text()))
    if args.quick:
        args.lengths, args.repeats, args.no_small_pool = [4096], 1, True
    lengths, budgets = sorted(args.lengths), sorted(b for b in args.budgets if b < 1.0)
    assert max(lengths) <= max(LENGTHS), "histories are prefixes of the 8000-token one"

    from transformers import AutoTokenizer

    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = common.model_facts(model_dir, DEFAULT_MODEL_NAME)
    pool_dtype, pool_bytes = common.cpu_pool_dtype()
    token_bytes = model.kv_bytes_per_token(pool_bytes)
    load_start = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    systems = {f"pruned_b{b:g}_{d}": ["--loopkv-prefix-budget", str(b)] for b in budgets for d in ("dense", "freekv")}
    for c, flags in systems.items():
        if c.endswith("freekv"):
            flags += ["--loopkv-decode-policy", "freekv"]
    systems["stream_b1_freekv"] = ["--loopkv-prefix-stream", "--loopkv-decode-policy", "freekv"]
    units = len(lengths) * (1 + len(systems)) + (0 if args.no_small_pool else 2)
    root = Path(tempfile.mkdtemp(prefix="loopkv-freekv-resume-"))
    payload: dict = {
        "config": {
            "command": "python -m benchmarks.studies.freekv_resume " + " ".join(sys.argv[1:]),
            "lengths": lengths,
            "budgets": budgets,
            "repeats": args.repeats,
            "gen": args.gen,
            "fidelity_tokens": FID,
            "model": model.name,
            "num_layers": model.num_layers,
            "n_periods": math.ceil(model.num_layers / PREFIX.period),
            "pool_dtype": pool_dtype,
            "token_bytes": token_bytes,
            "tau": TAU,
            "systems": {"load_all": [], **systems},
            "common_flags": [*COMMON, "--enable-custom-logit-processor"],
            "commit": commit.stdout.strip(),
        }
    }
    try:
        with tqdm(total=units, desc="freekv_resume") as bar:
            b = ResumeBench(args, tok, model, token_bytes, root, bar)
            for L in lengths:  # the reference first
                b.load_all(L)
            for i, (c, flags) in enumerate(systems.items()):
                b.pruned(c, flags, lengths, seed=i == 0 and not args.no_small_pool)
                payload["systems"] = json.loads(json.dumps(b.res))
                save(name, payload, load_start)  # after every system: a later failure keeps what was measured
            payload["reference"] = {str(L): r["output_ids"] for L, r in b.ref.items()}
            if not args.no_small_pool and max(lengths) == max(LENGTHS):
                payload["small_pool"] = b.small_pool(max(budgets))
            save(name, payload, load_start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    finish(name, payload)


def finish(name: str, payload: dict) -> None:
    """Summary, table and plot (again) from the measured payload."""
    payload["summary"] = summarize(payload)
    write_results(name, payload, report_md(payload))
    plot(payload, RESULTS / f"{name}.png")
    print(json.dumps(payload["summary"], indent=1))


if __name__ == "__main__":
    main()
