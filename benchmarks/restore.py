"""Restore benchmark (Krul): TTFT of a returning conversation's turn when its evicted history is
recomputed, loaded whole, partly recomputed with a fixed split, or restored by sgl-loopkv (the
cost-model planner, over compressed tiers); from the host arena and from disk; stored bytes per
token; fidelity vs dense; bubble fraction.

Systems (one server per system, tier and history length; a device pool just larger than the
history, so one filler request evicts it):
- full_recompute: sgl-loopkv attention, radix cache off (the history is prefilled again);
- full_load: tiered cache, ``load_all``, no compression (exact: the fidelity reference);
- fixed: ``fixed --loopkv-restore-ratio 0.4`` (Krul's 2:3 recompute:load in every layer);
- loopkv_planner: the ``krul`` planner (cost model calibrated on this machine), no compression;
- loopkv: the planner over int8 tiers (``--loopkv-store-dtype int8``): sgl-loopkv's compressed config;
- loopkv_share: loopkv plus Krul's cross-layer sharing (minicache codec, selection at its defaults);
- loopkv_encrypted: loopkv with its disk tier encrypted (``--loopkv-disk-key-file``, a fresh key), disk only:
  ``summary.encrypted_over_plain_disk_resume_4k`` is its 4K disk-resume TTFT over loopkv's.

Tiers: ``host`` (the history evicted from the device pool into the host arena) and ``disk`` (no
host arena; the segment files are dropped from the OS page cache before each resume).

Per configuration: the history is stored, then one untimed evict + resume (warm-up) and
``--repeats`` timed ones (each after the filler's own store has finished: ``SETTLE_S``) (TTFT of a
1-token request, median); then the restored KV (on the device by then) generates 128 greedy tokens
and scores full_load's 128 tokens teacher-forced. The servers of one history length and tier run side
by side (:func:`run_group`): each round of resumes visits every one of them in turn, so a slow spell of
this shared machine (whole minutes ~30% slower have been seen) lands on every system of a ratio alike
instead of on whichever server ran then. A TTFT ratio between two systems of a group (``full load
(same tier) / x`` and the ``ttft_full_load_over_*`` figures) is the median of their per-round ratios
(:func:`paired_ratio`).
Fidelity vs full_load (host): ``greedy_agreement`` = share of the 128 reference positions where the
system's top-1 token given the reference prefix (teacher forced) is the reference's own teacher-forced
top-1 (on the float32 path, its greedy token); ``prefix_agreement`` =
share of the system's own 128 greedy tokens before the first divergence (strict: one near-tie flips
the rest); first-token KL(full_load || system) over full_load's top-20 tokens plus the lumped tail.
Bubble fraction = seconds the forward waited for a layer's load / TTFT. Stored bytes per token =
tier bytes / tier tokens (key summaries, scales and file headers included); storage reduction = float32
KV bytes per token (stock SGLang's CPU pool) over them, and ``storage_reduction_vs_pool`` over the pool's.

``--weights default`` (the default) runs every server as a plain start does: the embedded model's GGUF
blocks over a bfloat16 KV pool; ``--weights float32`` the float32 conversion over a float32 pool.

Where a resume's time goes (issue 54): per timed resume, the server's ``loopkv_restore_seconds{part}``
(lookup, plan, fetch, alloc, loads_first, recompute on the scheduler thread; decode and copy on the
loader thread, or inside loads_first on a CPU pool; bubble) and ``loopkv_disk_seconds{part}`` (read, verify) deltas, medians over the repeats. Beside
them the "hot" TTFT: the same history still on the device, another turn of the same length over the same cached history (what the
new tokens' extend and the server's overheads cost with nothing to restore). The limit of a resume
is hot TTFT + history bytes / bandwidth: from the host tier, the pool's KV bytes of the history over
one thread's measured copy bandwidth (the loader copies on one thread); from disk, the tier's stored
bytes of the history over the measured sequential read bandwidth with the page cache dropped (both
measured in this process at the start of the run, :mod:`benchmarks.harness.bandwidth`).
``resume_over_limit`` = TTFT / limit.

    python -m benchmarks.restore                 # 2K/4K/8K, 7 repeats
    python -m benchmarks.restore --quick         # 4K only, 1 repeat
    python -m benchmarks.restore --resume        # go on from where a killed run of this commit stopped
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.common import (
    drop_page_cache,
    metrics,
    model_facts,
    synthetic_ids,
    teacher_forced_top1,
    timed_generate,
)
from benchmarks.harness import cli
from benchmarks.harness.bandwidth import cold_read_bps, copy_bps
from benchmarks.harness.env import load1, machine_label
from benchmarks.harness.plot import figure, log_lengths
from benchmarks.harness.results import RESULTS, Checkpoint, md_table
from benchmarks.harness.stats import median
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import DEFAULT_MODEL_NAME, ensure_default_model
from sgl_loopkv.server.process import ServerProcess

GEN = 128
TOPK = 20
#: pause after the filler turn: its store (write-through; with int8 tiers a quantization of its
#: 1100 tokens) runs on the scheduler thread after its answer, and a resume sent at once waited for it
SETTLE_S = 1.0
REQUIRED = ("full_load",)  # the fidelity reference (and every system's load-all baseline)
FILLER = 1100
HEAD = "loopkv"

SYSTEMS: dict[str, tuple[list[str] | None, tuple[str, ...]]] = {  # name -> (flags, tiers)
    "full_recompute": (None, ("-",)),
    "full_load": (["--loopkv-restore-planner", "load_all"], ("host", "disk")),
    "fixed": (["--loopkv-restore-planner", "fixed", "--loopkv-restore-ratio", "0.4"], ("host",)),
    "loopkv_planner": (["--loopkv-restore-planner", "krul"], ("host", "disk")),
    "loopkv": (["--loopkv-restore-planner", "krul", "--loopkv-tier-store-dtype", "int8"], ("host", "disk")),
    "loopkv_share": (
        ["--loopkv-restore-planner", "krul", "--loopkv-tier-store-dtype", "int8", "--loopkv-share-layers", "minicache"],
        ("host", "disk"),
    ),
    "loopkv_encrypted": (
        ["--loopkv-restore-planner", "krul", "--loopkv-tier-store-dtype", "int8"]
        + ["--loopkv-lifecycle-disk-key-file", "{key}"],
        ("disk",),
    ),
}

#: every server's weights and KV pool, by ``--weights``: ``default`` is a plain start (the embedded model's GGUF
#: blocks over a bfloat16 KV pool, what a user runs); ``float32`` the float32 conversion over a float32 pool (the
#: exact comparison with stock SGLang; studies/disk_cipher.py's servers)
WEIGHT_FLAGS = {"default": [], "float32": ["--loopkv-weights", "float32"]}
POOL_DTYPES = {"default": ("bfloat16", 2), "float32": ("float32", 4)}
WEIGHTS = WEIGHT_FLAGS["float32"]


def key_file() -> str:
    """A fresh 0600 key file for the encrypted system (the benchmark's, never a real one)."""
    fd, path = tempfile.mkstemp(prefix="loopkv-bench-", suffix=".key")  # mkstemp: mode 0600
    os.write(fd, os.urandom(32).hex().encode())
    os.close(fd)
    return path


#: Round r of resumes asks turn ``RESUME_TURNS + r``, round r of hot turns ``HOT_TURNS + r``: turns of
#: one length whose first chunk (16 tokens) is common to all, so that a resume and a hot turn extend
#: the same number of tokens over the same cached history (the extend attends to the whole history:
#: each new token cost ~3 ms at 4K, and a hot turn of other tokens made a limit that was no floor).
RESUME_TURNS, HOT_TURNS = 10, 50


def turn_ids(tok, variant: int = 0) -> list[int]:
    """The returning turn; ``variant`` > 0: another turn of about the same length (a hot run's)."""
    topic = "the river and the museum" if variant == 0 else f"the bridge and the market, part {variant}"
    return tok(f"\nUser: Summarise what was said about {topic}.\nAssistant:", add_special_tokens=False)["input_ids"]


#: the metric samples a resume's breakdown is read from (deltas around it): name -> stage
STAGE_SAMPLES = {
    **{
        f'loopkv_restore_seconds_total{{part="{p}"}}': p
        for p in ("held", "lookup", "plan", "fetch", "alloc", "loads_first", "recompute")
    },
    **{f'loopkv_restore_seconds_total{{part="{p}"}}': p for p in ("decode", "copy", "bubble")},
    'loopkv_disk_seconds_total{part="read"}': "disk_read",
    'loopkv_disk_seconds_total{part="verify"}': "disk_verify",
    'loopkv_disk_seconds_total{part="total"}': "disk_total",
}
#: the stages that run one after another on the scheduler thread before the forward starts
SERIAL_STAGES = ("held", "lookup", "plan", "fetch", "alloc", "loads_first", "recompute")


def _generate(url: str, body: dict) -> dict:
    r = requests.post(f"{url}/generate", json=body, timeout=900)
    r.raise_for_status()
    return r.json()["meta_info"]


def first_token_logprobs(url: str, ids: list[int], token_ids: list[int] | None) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": TOPK,
    }
    if token_ids:
        body["token_ids_logprob"] = token_ids
    m = _generate(url, body)
    top = {int(t): float(lp) for lp, t, *_ in m["output_top_logprobs"][0]}
    chosen = {int(t): float(lp) for lp, t, *_ in (m.get("output_token_ids_logprobs") or [[]])[0] or []}
    return {"top": top, "chosen": chosen}


def kl_topk(ref: dict[int, float], ours: dict[int, float]) -> float:
    """KL(ref || ours) over ref's top tokens plus one lumped tail bucket."""
    p = {t: math.exp(lp) for t, lp in ref.items()}
    q = {t: math.exp(ours[t]) for t in ref}
    kl = sum(p[t] * (math.log(p[t]) - math.log(max(q[t], 1e-30))) for t in p)
    pt, qt = max(1 - sum(p.values()), 1e-12), max(1 - sum(q.values()), 1e-12)
    return kl + pt * (math.log(pt) - math.log(qt))


def agreement(ours: list[int], ref: list[int]) -> float:
    """Share of the ``GEN`` positions where two top-1 sequences agree."""
    return sum(a == b for a, b in zip(ours, ref)) / GEN


def prefix_agreement(ours: list[int], ref: list[int]) -> float:
    n = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    return n / len(ref)


class ResumeRun:
    """One system's server for one tier and history length, driven a step at a time (:func:`run_group`
    interleaves the servers of a group): the stored history, timed resumes, hot turns, fidelity."""

    BUBBLE = 'loopkv_restore_seconds_total{part="bubble"}'

    def __init__(self, name: str, tier: str, tok, L: int, weights: str):
        flags, _ = SYSTEMS[name]
        self.name, self.tier, self.tok, self.L = name, tier, tok, L
        self.tiered = flags is not None
        self.hist = synthetic_ids(tok, L, seed=L)
        self.prompt = self.hist + turn_ids(tok)
        pool = ["--max-total-tokens", str(L + 1024)]
        self.disk_dir = Path(tempfile.mkdtemp(prefix="loopkv-restore-")) if tier == "disk" else None
        if not self.tiered:
            args = ["--disable-radix-cache", *pool]
        else:
            flags = [key_file() if f == "{key}" else f for f in flags]
            host = (
                ["--loopkv-tier-host-bytes", "0", "--loopkv-tier-disk-dir", str(self.disk_dir)] if self.disk_dir else []
            )
            args = [*pool, "--enable-metrics", *host, *flags]
        log = RESULTS / f"restore_{name}_{tier}_{L}.log"
        self.srv = ServerProcess([*WEIGHT_FLAGS[weights], *args], log_path=log)
        self.runs: list[dict] = []
        self.hot: list[float] = []
        self.fidelity: dict = {}

    def start(self) -> None:
        """Wait for the spawned server, then store the earlier turn (a tiered system)."""
        self.srv.wait_ready(600)
        if self.tiered:
            timed_generate(self.srv.url, self.hist, 1)

    def resume(self, r: int) -> None:
        """Evict the history, then time the returning turn (round 0 warms up, untimed)."""
        url = self.srv.url
        if self.tiered:  # evict the history (over 4K it may be two radix nodes)
            filler = synthetic_ids(self.tok, FILLER + (4096 if self.L > 4096 else 0), seed=10_000 + 100 * self.L + r)
            timed_generate(url, filler, 1)
            time.sleep(SETTLE_S)  # the filler's own turn is stored (int8: quantized) before the resume
            if self.disk_dir:
                drop_page_cache(self.disk_dir)
            m0 = metrics(url)
        res = timed_generate(url, self.hist + turn_ids(self.tok, RESUME_TURNS + r), 1)
        if self.tiered:
            m1 = metrics(url)
            t = "disk" if self.disk_dir else "host"
            got = res["meta_info"]["cached_tokens_details"]["storage" if self.disk_dir else "host"]
            assert got >= self.L - 16, (
                f"{self.name}/{self.tier}: resume served {res['meta_info']['cached_tokens_details']}"
            )
            res["bubble_s"] = m1.get(self.BUBBLE, 0.0) - m0.get(self.BUBBLE, 0.0)
            res["stages_s"] = {st: m1.get(k, 0.0) - m0.get(k, 0.0) for k, st in STAGE_SAMPLES.items()}
            res["front_first"] = m1.get('loopkv_restore_last_front_tokens{layer="first"}', 0.0)
            res["front_last"] = m1.get('loopkv_restore_last_front_tokens{layer="last"}', 0.0)
            res["bytes_per_token"] = m1[f'loopkv_tier_bytes{{tier="{t}"}}'] / max(
                m1[f'loopkv_tier_tokens{{tier="{t}"}}'], 1
            )
        if r:
            self.runs.append(res)

    def hot_turn(self, r: int) -> None:
        """The history on the device now: a new turn's extend with nothing to restore (round 0 untimed)."""
        if not self.tiered:
            return
        res = timed_generate(self.srv.url, self.hist + turn_ids(self.tok, HOT_TURNS + r), 1)
        assert res["meta_info"]["cached_tokens"] >= self.L - 16, (
            f"{self.name}/{self.tier}: the hot run missed its history"
        )
        if r:
            self.hot.append(res["ttft_s"])

    def score(self, ref: dict | None) -> None:
        """Fidelity on the restored KV (still in the device pool: these requests hit it)."""
        url, prompt = self.srv.url, self.prompt
        out_ids = timed_generate(url, prompt, GEN)["output_ids"]
        lp = first_token_logprobs(url, prompt, list(ref["logprobs"]["top"]) if ref else None)
        tf = teacher_forced_top1(url, prompt, ref["output_ids"] if ref else out_ids)
        self.fidelity = {"output_ids": out_ids, "logprobs": lp, "teacher_forced": tf}

    def result(self) -> dict:
        runs = self.runs
        out = {"ttft_s": median([x["ttft_s"] for x in runs]), "ttfts_s": [x["ttft_s"] for x in runs]}
        out |= self.fidelity
        for key in ("bubble_s", "front_first", "front_last", "bytes_per_token"):
            if key in runs[0]:
                out[key] = median([x[key] for x in runs])
        if "bubble_s" in out:
            out["bubble_fraction"] = out["bubble_s"] / out["ttft_s"]
        if self.hot:
            out["hot_ttft_s"] = median(self.hot)
            out["hot_ttfts_s"] = self.hot
            out["stages_s"] = {st: median([x["stages_s"][st] for x in runs]) for st in STAGE_SAMPLES.values()}
        return out


def run_group(runs: list[ResumeRun], repeats: int, ref: dict | None) -> None:
    """The servers of one history length and tier side by side: started together, then each round of
    resumes (and of hot turns) visits every server, in an order that rotates by round, so a slow spell
    of the machine falls on every system alike and the ratios between them hold; fidelity last (the
    reference, full_load/host, first when it is in the group)."""
    try:
        for x in runs:
            x.srv.spawn()
        for x in runs:
            x.start()
        for step in (ResumeRun.resume, ResumeRun.hot_turn):
            for r in range(repeats + 1):
                k = r % len(runs)
                for x in runs[k:] + runs[:k]:
                    step(x, r)
                    if step is ResumeRun.hot_turn:  # its turn's store done before the next server's is timed
                        time.sleep(SETTLE_S)
        for x in runs:
            x.score(ref)
            if (x.name, x.tier) == ("full_load", "host"):
                ref = x.result()
    finally:
        for x in runs:
            x.srv.stop()


def paired_ratio(base: dict, other: dict) -> float | None:
    """``base``'s TTFT over ``other``'s, two results of one group (every round of resumes visits both,
    side by side): the median of their per-round ratios, so that the machine's drift between rounds
    cancels; the ratio of their medians where the rounds do not pair."""
    a, b = base.get("ttfts_s"), other.get("ttfts_s")
    if a and b and len(a) == len(b):
        return median([x / y for x, y in zip(a, b)])
    if base.get("ttft_s") is None or other.get("ttft_s") is None:
        return None
    return base["ttft_s"] / other["ttft_s"]


def add_limit(r: dict, tier: str, L: int, pool_bytes_per_token: int, bw: dict) -> None:
    """``limit_s`` (hot TTFT + the history's bytes over the tier's bandwidth), ``resume_over_limit``
    and ``other_s``: the TTFT none of the measured stages or the hot run explains."""
    if "hot_ttft_s" not in r:
        return
    if tier == "host":
        move_s = L * pool_bytes_per_token / bw["copy_bps"]
    else:
        move_s = L * r["bytes_per_token"] / bw["cold_read_bps"]
    r["limit_s"] = r["hot_ttft_s"] + move_s
    r["resume_over_limit"] = r["ttft_s"] / r["limit_s"]
    st = r["stages_s"]
    r["other_s"] = r["ttft_s"] - r["hot_ttft_s"] - sum(st[x] for x in SERIAL_STAGES) - st["bubble"]


def _int_token_keys(piece: dict) -> dict:
    """A stored piece's logprob maps keyed by token id again (JSON keys are strings)."""
    lp = piece["logprobs"]
    return piece | {"logprobs": {k: {int(t): v for t, v in lp[k].items()} for k in lp}}


def _int_lengths(p: dict) -> dict:
    return {n: {t: {int(L): r for L, r in v.items()} for t, v in tiers.items()} for n, tiers in p["systems"].items()}


def _configs(p: dict) -> list[tuple[str, str]]:
    """(system, tier) in the order they ran: the reference first."""
    configs = [(n, t) for n, tiers in p["systems"].items() for t in tiers]
    configs.remove(("full_load", "host"))
    return [("full_load", "host"), *configs]


def plot(p: dict, path: Path) -> None:
    results, lengths = _int_lengths(p), p["lengths"]
    styles = dict(zip(p["systems"], ("--s", "-o", "-^", "-D", "-*", "-v", ":x")))
    with figure(path, 1, 2, size=(11, 4.2), dpi=120, sharey=True) as (fig, axes):
        for ax, tier in zip(axes, ("host", "disk")):
            for i, name in enumerate(p["systems"]):  # one colour per system in both panels
                key = tier if tier in results[name] else ("-" if name == "full_recompute" else None)
                if key is None:
                    continue
                ax.plot(lengths, [results[name][key][L]["ttft_s"] for L in lengths], styles[name], color=f"C{i}",
                        label=name)  # fmt: skip
            ax.set(yscale="log", xlabel="history tokens", title=f"history evicted to the {tier} tier")
            log_lengths(ax, lengths)
        axes[0].set_ylabel("returning-turn TTFT (s, median)")
        axes[0].legend(fontsize=8)
        fig.suptitle("Restoring an evicted conversation (SmolLM2-135M, CPU)")


def report_md(p: dict) -> str:
    results, lengths, env, model, s = _int_lengths(p), p["lengths"], p["env"], p["model"], p["summary"]
    rows = []
    for L in lengths:
        for name, tier in _configs(p):
            r = results[name][tier][L]
            rows.append(
                [
                    L,
                    name,
                    tier,
                    r["ttft_s"],
                    results["full_recompute"]["-"][L]["ttft_s"] / r["ttft_s"] if "full_recompute" in results else "-",
                    paired_ratio(results["full_load"][tier if tier != "-" else "host"][L], r),
                    f"{r['front_first']:.0f}..{r['front_last']:.0f}" if "front_first" in r else "-",
                    r.get("bubble_fraction", "-"),
                    r.get("bytes_per_token", "-"),
                    model.get("fp32_kv_bytes_per_token", model["kv_bytes_per_token"]) / r["bytes_per_token"]
                    if "bytes_per_token" in r
                    else "-",
                    r["greedy_agreement"],
                    r["prefix_agreement"],
                    r["first_token_kl"],
                ]
            )
    share = s["per_system"].get("loopkv_share")
    return (
        f"# restore ({env['when']}; `{env['command']}`, "
        f"median of {p['repeats']} timed resume(s) after a warm-up; load average {load1(env['loadavg_start']):.1f} "
        f"at start, {load1(env['loadavg_end']):.1f} at end)\n\n"
        f"{model['name']} ({model['num_layers']} layers; "
        f"{'a plain start: GGUF blocks' if model.get('weights') == 'default' else 'float32 weights'}), "
        f"{model['pool_dtype']} KV pool, {machine_label(env)}. "
        "Returning turn of a conversation whose history was "
        "evicted from the device pool to the host arena (`host`) or, with no arena, to disk with the page cache "
        "dropped (`disk`). Systems:\n\n"
        + "".join(f"- {n}: `{' '.join(f) if f else '--disable-radix-cache'}`\n" for n, f in p["flags"].items())
        + "\n"
        + md_table(
            [
                "history",
                "system",
                "tier",
                "TTFT s",
                "recompute / x",
                "full load (same tier) / x",
                "front tokens recomputed (layer 0..last)",
                "bubble fraction",
                "stored B/token",
                "reduction vs fp32 KV",
                "greedy agreement (teacher-forced)",
                "prefix agreement",
                "first-token KL",
            ],
            rows,
        )
        + "\n"
        + breakdown_md(p)
        + "\n"
        + summary_md(s, share)
    )


def _x(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def summary_md(s: dict, share: dict | None) -> str:
    out = (
        f"Summary (`{s['headline_system']}`, host tier unless said): TTFT vs full recompute "
        f"{_x(s['ttft_recompute_over_loopkv_4k'], '.1f')}x at 4K (target 5x); vs full load "
        f"{_x(s['ttft_full_load_over_loopkv_4k'])}x (host) and {_x(s['ttft_full_load_over_loopkv_4k_disk'])}x (disk) "
        f"(target 2.5x), {_x(s.get('ttft_full_load_over_loopkv_min'))}x at worst over every history and tier "
        f"(target >= 1); slowest resume {_x(s.get('resume_over_limit_max'))}x its limit (target <= 1.5); "
        f"storage reduction {_x(s['storage_reduction'])}x host, {_x(s['storage_reduction_disk'])}x disk "
        f"(target 3x) against float32 KV, {_x(s.get('storage_reduction_vs_pool'))}x against the pool's own; "
        f"greedy agreement {_x(s['greedy_agreement'], '.3f')} (target 0.9; the reference's own teacher-forced top-1 "
        f"agree with its greedy tokens at {_x(s.get('reference_self_agreement'), '.3f')}), prefix agreement "
        f"{_x(s['prefix_agreement'])}; first-token KL at most {_x(s['first_token_kl_max'], '.2g')}; bubble fraction "
        f"{_x(s['bubble_fraction'], '.3f')}; uncompressed plans exact (greedy identical): "
        f"{s['exact_without_compression']}."
    )
    if share:
        out += (
            f" With sharing (`loopkv_share`): {_x(share['storage_reduction'])}x host, greedy agreement "
            f"{_x(share['greedy_agreement'], '.3f')}, prefix agreement {_x(share['prefix_agreement'])}, first-token KL "
            f"up to {_x(share['first_token_kl_max'], '.2g')}."
        )
    bw = s.get("bandwidth")
    if bw:
        out += (
            f" Bandwidths of the limits: copy {bw['copy_bps'] / 1e9:.1f} GB/s (one thread), cold sequential read "
            f"{bw['cold_read_bps'] / 1e9:.2f} GB/s."
        )
    return out + "\n"


def breakdown_md(p: dict) -> str:
    """Where each resume's time goes (ms, medians over the repeats) next to its limit."""
    results, lengths = _int_lengths(p), p["lengths"]
    rows = []
    for L in lengths:
        for name, tier in _configs(p):
            r = results[name][tier][L]
            if "stages_s" not in r:
                continue
            st = r["stages_s"]
            ms = [
                1000 * st[k]
                for k in (*SERIAL_STAGES, "disk_total", "disk_read", "disk_verify", "decode", "copy", "bubble")
            ]
            rows.append(
                [L, name, tier, 1000 * r["ttft_s"], 1000 * r["hot_ttft_s"], 1000 * r["limit_s"],
                 r["resume_over_limit"], *ms, 1000 * r["other_s"]]
            )  # fmt: skip
    if not rows:
        return ""
    head = ["history", "system", "tier", "TTFT ms", "hot TTFT ms", "limit ms", "TTFT / limit"]
    head += [f"{k} ms" for k in SERIAL_STAGES] + [
        "disk ms",
        "pread ms",
        "verify ms",
        "decode ms",
        "copy ms",
        "bubble ms",
    ]
    return (
        "Where a resume's time goes (ms, medians over the timed resumes). hot TTFT: the same history on the "
        "device, a new turn of the same length; limit: hot TTFT + the history's bytes over the measured "
        "bandwidth (host: pool bytes over one thread's copy; disk: stored bytes over a cold sequential read). "
        "held: sat out scheduler rounds while the read-ahead thread read its disk-only history; lookup ... recompute "
        "run one after another on the scheduler thread before the forward; disk (a whole read: pread, verify "
        "and the tensors built from them) is inside held or fetch; decode and copy run on the loader "
        "thread beside the forward, which waits for them only in bubble, or (a CPU pool) inside loads_first; other = TTFT - hot TTFT - the "
        "scheduler-thread stages - bubble (the extend slowed by the loader sharing its cores, and the rest).\n\n"
        + md_table([*head, "other ms"], rows)
    )


def run(args, env: dict) -> dict:
    lengths, repeats = ([4096], 1) if args.quick else (sorted(args.lengths), args.repeats)
    assert 4096 in lengths, "the summary is at 4K"
    assert RESUME_TURNS + repeats < HOT_TURNS and HOT_TURNS + repeats < 100, "turns of one length"

    from transformers import AutoTokenizer

    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = model_facts(model_dir, DEFAULT_MODEL_NAME)
    pool_dtype, pool_bytes = POOL_DTYPES[args.weights]
    full_kv_bytes = model.kv_bytes_per_token(pool_bytes)  # the KV pool's bytes per token (no summaries)
    # storage reduction against float32 KV: what stock SGLang's CPU pool keeps for this model, whichever pool
    # these servers run (a plain start's bfloat16 pool halves it before any tier compression)
    fp32_kv_bytes = model.kv_bytes_per_token(4)
    configs = [(n, t) for n, (_, tiers) in SYSTEMS.items() for t in tiers]
    configs.remove(("full_load", "host"))
    configs.insert(0, ("full_load", "host"))  # the reference first
    configs = [c for c in configs if args.systems is None or c[0] in args.systems or c[0] in REQUIRED]
    bw = {"copy_bps": copy_bps(), "cold_read_bps": cold_read_bps(tempfile.gettempdir())}
    results: dict = {n: {t: {} for t in tiers} for n, (_, tiers) in SYSTEMS.items() if any(c[0] == n for c in configs)}
    results = {n: {t: v for t, v in tiers.items() if (n, t) in configs} for n, tiers in results.items()}
    # a piece depends on the code, the lengths and the repeats; ~1 h on 2 cores, so a killed run resumes
    ckpt = Checkpoint(
        args.out,
        {"lengths": lengths, "repeats": repeats, "commit": env.get("git"), "weights": args.weights},
        args.resume,
    )
    # one group per history length and tier (the host group holds full_recompute and the reference, which
    # the disk group's fidelity needs first)
    groups = [[c for c in configs if (c[1] == "disk") == disk] for disk in (False, True)]
    with tqdm(total=len(configs) * len(lengths), desc="restore") as bar:
        for L in lengths:
            for group in groups:
                for n, t in group:  # pieces a killed run finished (the reference among them)
                    if ckpt.get(f"{n}/{t}/{L}") is not None:
                        results[n][t][L] = _int_token_keys(ckpt.get(f"{n}/{t}/{L}"))
                todo = [c for c in group if ckpt.get(f"{c[0]}/{c[1]}/{L}") is None]
                bar.set_postfix_str(f"{L}: {', '.join(f'{n}/{t}' for n, t in todo)}")
                if todo:
                    runs = [ResumeRun(n, t, tok, L, args.weights) for n, t in todo]
                    run_group(runs, repeats, results["full_load"]["host"].get(L))
                    for x in runs:
                        ckpt.put(f"{x.name}/{x.tier}/{L}", x.result())
                        results[x.name][x.tier][L] = _int_token_keys(ckpt.get(f"{x.name}/{x.tier}/{L}"))
                bar.update(len(group))
    for L in lengths:
        ref = results["full_load"]["host"][L]
        # each system's top-1 against the reference's, both teacher-forced on the reference's tokens (one
        # computation, a prefill of the same sequence): on the float32 path the reference's teacher-forced
        # top-1 are its greedy tokens; a plain start's bfloat16 prefills round differently from its float32
        # decode steps, so there they can differ at near-ties (``reference_self_agreement``)
        ref["reference_self_agreement"] = agreement(ref["teacher_forced"], ref["output_ids"])
        for name, tier in configs:
            r = results[name][tier][L]
            r["greedy_agreement"] = agreement(r["teacher_forced"], ref["teacher_forced"])
            r["prefix_agreement"] = prefix_agreement(r["output_ids"], ref["output_ids"])
            ours = {**r["logprobs"]["top"], **r["logprobs"]["chosen"]}
            r["first_token_kl"] = (
                0.0 if (name, tier) == ("full_load", "host") else kl_topk(ref["logprobs"]["top"], ours)
            )
            r["identical"] = r["output_ids"] == ref["output_ids"]
            add_limit(r, tier, L, full_kv_bytes, bw)
    self_agreement = min(results["full_load"]["host"][L]["reference_self_agreement"] for L in lengths)
    if args.weights == "float32":  # one exact computation: teacher forcing reproduces the greedy tokens
        assert self_agreement == 1.0, "teacher forcing does not reproduce itself"

    def ttft(name, tier="host", L=4096):
        return results.get(name, {}).get(tier, {}).get(L, {}).get("ttft_s")

    def over(a, b):
        return None if a is None or b is None else a / b

    def load_over(name, tier="host", L=4096):  # full_load's TTFT over name's, round by round
        a, b = results.get("full_load", {}).get(tier, {}).get(L), results.get(name, {}).get(tier, {}).get(L)
        return None if a is None or b is None else paired_ratio(a, b)

    def system_summary(name: str) -> dict:
        res = results[name]
        every = [res[t][L] for t in res for L in lengths]
        limits = [r["resume_over_limit"] for r in every if "resume_over_limit" in r]
        vs_load = [load_over(name, t, L) for t in ("host", "disk") for L in lengths]
        return {
            "storage_reduction": fp32_kv_bytes / median([res["host"][L]["bytes_per_token"] for L in lengths])
            if "host" in res
            else None,
            "storage_reduction_disk": fp32_kv_bytes / median([res["disk"][L]["bytes_per_token"] for L in lengths])
            if "disk" in res
            else None,
            "storage_reduction_vs_pool": full_kv_bytes / median([res["host"][L]["bytes_per_token"] for L in lengths])
            if "host" in res
            else None,
            "greedy_agreement": min(r["greedy_agreement"] for r in every),
            "prefix_agreement": min(r["prefix_agreement"] for r in every),
            "first_token_kl_max": max(r["first_token_kl"] for r in every),
            "bubble_fraction": median([r["bubble_fraction"] for r in every]),
            "ttft_recompute_over_it_4k": over(ttft("full_recompute", "-"), ttft(name)),
            "ttft_full_load_over_it_4k": load_over(name),
            "ttft_full_load_over_it_4k_disk": load_over(name, "disk"),
            # every history size and tier: the planner's choice against its simplest candidate
            "ttft_full_load_over_it_min": min((v for v in vs_load if v is not None), default=None),
            "resume_over_limit_max": max(limits, default=None),
        }

    head = system_summary(HEAD) if HEAD in results else {}
    summary = {
        "headline_system": HEAD,
        "ttft_recompute_over_loopkv_4k": head.get("ttft_recompute_over_it_4k"),
        "ttft_full_load_over_loopkv_4k": head.get("ttft_full_load_over_it_4k"),
        "ttft_full_load_over_loopkv_4k_disk": head.get("ttft_full_load_over_it_4k_disk"),
        "ttft_full_load_over_loopkv_min": head.get("ttft_full_load_over_it_min"),
        "resume_over_limit_max": head.get("resume_over_limit_max"),
        "ttft_fixed_over_loopkv_4k": over(ttft("fixed"), ttft(HEAD)),
        "encrypted_over_plain_disk_resume_4k": over(ttft("loopkv_encrypted", "disk"), ttft(HEAD, "disk")),
        **{k: head.get(k) for k in ("storage_reduction", "storage_reduction_disk", "greedy_agreement")},
        "storage_reduction_vs_pool": head.get("storage_reduction_vs_pool"),
        **{k: head.get(k) for k in ("prefix_agreement", "first_token_kl_max", "bubble_fraction")},
        "reference_self_agreement": self_agreement,
        "exact_without_compression": all(
            results[n][t][L]["identical"]
            for n in ("full_recompute", "full_load", "fixed", "loopkv_planner")
            for t in results.get(n, {})
            for L in lengths
        ),
        "per_system": {
            n: system_summary(n) for n in ("full_load", "loopkv_planner", "loopkv", "loopkv_share") if n in results
        },
        "bandwidth": bw,
        "targets": {
            "ttft_recompute_over_loopkv_4k": 5,
            "ttft_full_load_over_loopkv_4k": 2.5,
            "ttft_full_load_over_loopkv_min": 1.0,
            "resume_over_limit_max": 1.5,  # at most
            "storage_reduction": 3,
            "greedy_agreement": 0.9,
            "encrypted_over_plain_disk_resume_4k": 1.15,  # at most
        },
    }
    for n, t, L in ((n, t, L) for n, t in configs for L in lengths):
        for key in ("output_ids", "teacher_forced"):
            results[n][t][L].pop(key)
    model_rec = {"name": model.name, "num_layers": model.num_layers, "pool_dtype": pool_dtype,
                 "kv_bytes_per_token": full_kv_bytes, "fp32_kv_bytes_per_token": fp32_kv_bytes,
                 "weights": args.weights}  # fmt: skip
    payload = {"summary": summary, "systems": results, "flags": {n: f for n, (f, _) in SYSTEMS.items()}}
    ckpt.finish()  # only now: a summary that fails keeps the finished servers' pieces for --resume
    return payload | {"lengths": lengths, "repeats": repeats, "model": model_rec}


BENCH = cli.Benchmark("restore", run, report_md, plot)


def main() -> None:
    ap = cli.parser(BENCH, __doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="4K only, 1 repeat")
    ap.add_argument("--weights", choices=list(WEIGHT_FLAGS), default="default",
                    help="default: a plain start (GGUF blocks, bfloat16 KV pool); float32: the float32 conversion and pool")  # fmt: skip
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=None,
                    help="only these systems (plus the reference full_load): a partial summary")  # fmt: skip
    ap.add_argument("--resume", action="store_true",
                    help="reuse the configurations a killed run of the same commit, lengths and repeats finished")  # fmt: skip
    cli.main(BENCH, ap)


if __name__ == "__main__":
    main()
