"""How long torch's idle OpenMP threads spin before they sleep, in a served decode (``GOMP_SPINCOUNT``).

The default model's GGUF server, one per setting, the settings alternating round after round (the
machine drifts; the order flips every round): ``unset`` = libgomp's own default (300,000 polls before an
idle thread sleeps), the others ``GOMP_SPINCOUNT`` given. Each server fills one context of
``--context`` tokens and seven more that share all but its last 64 (as :mod:`benchmarks.decode`'s grid),
then decodes one request alone and eight together, greedy. TPOT = the streamed inter-arrival time
(:func:`benchmarks.decode.token_intervals`, mean over the steady window); the CPU the server's processes
used per generated token, from ``/proc``.

    python -m benchmarks.studies.openmp_waits              # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.decode import stream_generate, token_intervals
from benchmarks.harness.env import environment, finish, machine_label
from benchmarks.harness.results import md_table
from benchmarks.studies import RESULTS, write_results
from sgl_loopkv.models import default_model_gguf
from sgl_loopkv.server.process import ServerProcess

TAIL = 64


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def decode(url: str, pids: list[int], contexts: list[list[int]], gen: int) -> dict:
    """TPOT (ms) and server CPU (ms per token) of ``len(contexts)`` concurrent greedy streams."""
    out: list[dict | None] = [None] * len(contexts)
    barrier = threading.Barrier(len(contexts))

    def one(i: int) -> None:
        out[i] = stream_generate(url, contexts[i], gen, barrier)

    c0 = cpu_seconds(pids)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contexts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = cpu_seconds(pids) - c0
    intervals, tok_s = token_intervals([o["arrivals"] for o in out])
    return {
        "tpot_ms": 1000 * statistics.mean(intervals),
        "tok_s": tok_s,
        "cpu_ms_per_token": 1000 * cpu / (gen * len(contexts)),
    }


def one_server(spins: str, contexts: list[list[int]], gen: int, log: Path) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env = {} if spins == "unset" else {"GOMP_SPINCOUNT": spins}
    srv = ServerProcess(["--model-path", str(default_model_gguf())], env=env, base_env=base, log_path=log)
    with srv.start():
        for ids in contexts:  # into the radix cache, untimed
            stream_generate(srv.url, ids, 1)
        pids = srv.pids()
        return {"bs1": decode(srv.url, pids, contexts[:1], gen), "bs8": decode(srv.url, pids, contexts, gen // 2)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    out: dict = {"tpot_ms": {}, "cpu_ms_per_token": {}, "over_unset": {}}
    for spins, rs in runs.items():
        for bs in ("bs1", "bs8"):
            out["tpot_ms"].setdefault(spins, {})[bs] = statistics.median(r[bs]["tpot_ms"] for r in rs)
            out["cpu_ms_per_token"].setdefault(spins, {})[bs] = statistics.median(r[bs]["cpu_ms_per_token"] for r in rs)
    for spins, rs in runs.items():
        if spins == "unset":
            continue
        for bs in ("bs1", "bs8"):  # per round: this setting's TPOT over libgomp's default in the same round
            paired = [r[bs]["tpot_ms"] / b[bs]["tpot_ms"] for r, b in zip(rs, runs["unset"])]
            out["over_unset"].setdefault(spins, {})[bs] = statistics.median(paired)
            out["over_unset"].setdefault(spins, {})[f"{bs}_rounds_faster"] = sum(p < 1 for p in paired)
    out["rounds"] = len(runs["unset"])
    return out


def report(payload: dict) -> str:
    env, s = payload["environment"], payload["summary"]
    rows = []
    for spins in payload["runs"]:
        o = s["over_unset"].get(spins, {})
        rows.append(
            [spins if spins != "unset" else "unset (libgomp: 300000)"]
            + [f"{s['tpot_ms'][spins][bs]:.1f}" for bs in ("bs1", "bs8")]
            + [f"{o[bs]:.2f}x" if bs in o else "-" for bs in ("bs1", "bs8")]
            + [f"{s['cpu_ms_per_token'][spins][bs]:.1f}" for bs in ("bs1", "bs8")]
        )
    head = ["GOMP_SPINCOUNT", "TPOT ms bs 1", "TPOT ms bs 8", "/ unset's, bs 1", "/ unset's, bs 8"]
    head += ["server CPU ms / token, bs 1", "bs 8"]
    return (
        f"# openmp_waits ({env['when']}; `python -m benchmarks.studies.openmp_waits`; {env.get('cpu_model')}, "
        f"{machine_label(env)})\n\n"
        f"The default model's GGUF server at {payload['context']} tokens of context, one request alone and eight "
        f"sharing all but their last {TAIL} tokens; medians over {s['rounds']} rounds, the settings alternating "
        "(their order flipped every round); "
        "a ratio is the median of the rounds' own ratios (same round, same machine state).\n\n"
        + md_table(head, rows)
        + "\n\n"
        + "".join(
            f"{k} over libgomp's default: bs 1 **{o['bs1']:.2f}x** (faster in {o['bs1_rounds_faster']} of "
            f"{s['rounds']} rounds), bs 8 **{o['bs8']:.2f}x** (faster in {o['bs8_rounds_faster']}).\n"
            for k, o in s["over_unset"].items()
        )
    )


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, bs in zip(axes, ("bs1", "bs8")):
        for i, rs in enumerate(payload["runs"].values()):
            ys = [r[bs]["tpot_ms"] for r in rs]
            ax.plot([i] * len(ys), ys, "o", alpha=0.6)
        ax.set_xticks(range(len(payload["runs"])), list(payload["runs"]), fontsize=8)
        ax.set_title(f"TPOT, {bs.replace('bs', 'batch ')}")
        ax.set_ylabel("ms")
    fig.suptitle("GOMP_SPINCOUNT in a served GGUF decode (each dot a round)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spins", nargs="+", default=["unset", "20000"], help="GOMP_SPINCOUNT values ('unset': libgomp's)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=200, help="tokens per request alone (half that for eight)")
    args = ap.parse_args()
    if "unset" not in args.spins:
        args.spins.insert(0, "unset")
    env = environment()
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(args.context - TAIL)]
    contexts = [shared + [rng.randrange(100, 40000) for _ in range(TAIL)] for _ in range(8)]
    runs: dict[str, list[dict]] = {s: [] for s in args.spins}
    log = RESULTS / "openmp_waits.log"
    with tqdm(total=args.rounds * len(args.spins), desc="openmp waits") as bar:
        for r in range(args.rounds):
            # the order flips every round: in two earlier versions, the first server of a round was
            # slower than the second by more than the settings differed
            for spins in args.spins if r % 2 == 0 else args.spins[::-1]:
                bar.set_postfix_str(spins)
                runs[spins].append(one_server(spins, contexts, args.gen, log))
                bar.update()
    payload = {"runs": runs, "context": args.context, "gen": args.gen, "environment": finish(env)}
    payload["summary"] = summarize(runs)
    md = report(payload)
    write_results("openmp_waits", payload, md + "\n![openmp_waits](openmp_waits.png)\n")
    plot(payload, RESULTS / "openmp_waits.png")
    print(md)


if __name__ == "__main__":
    main()
