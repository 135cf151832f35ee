"""A history too big for the host arena, resumed again and again from disk: what the host chunk
cache (issue 15, item 4: ContiguousKV's attention-guided chunk cache) saves.

One 4K-token SmolLM2 history stored on disk (the re-prefill benchmark's), then ``--resumes``
returning turns, each a different question about it, each after the segment files are dropped from
the page cache (before them, one resume of another stored history takes the server's first-restore
costs). The host arena (``--host-mb``) is smaller than the history, so a full load never
promotes it and every full load reads it from disk again. Systems, each its own server on its own
copy of the stored history, in one run:

- ``load_all``: budget 1.0 (today's default path: read and verify the history whole, then admit);
- ``pruned``: budget 0.1 with ``--loopkv-prefix-no-host-cache`` (every resume reads its chunks from disk);
- ``pruned+cache``: budget 0.1, chunks read from disk kept in the arena's free room by chunk value;
- ``pruned+cache-small``: the same with an arena of ``--small-mb`` (less than one resume reads);
- ``pruned-host``: budget 0.1 with the whole history in a large host arena (the ceiling: no disk).

Per resume: TTFT, disk bytes read, the share of the loaded chunks that came from the chunk cache.
Resume 1 is cold for every system; the others show what a warm cache buys.

    python -m benchmarks.studies.chunk_cache            # about 4 minutes

Writes benchmarks/results/chunk_cache.{json,md,png}.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import metrics, synthetic_ids, timed_generate
from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.results import md_table
from benchmarks.harness.stats import median
from benchmarks.reprefill import CHUNK, COMMON, FILLER, HIST_SEED, P, clone_dir, metrics_after, turn_ttft
from benchmarks.studies import RESULTS, write_results
from benchmarks.studies.resume import drop_page_cache
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import ensure_default_model
from sgl_loopkv.server.process import ServerProcess

L = 4096
BUDGET = 0.1
MB = 1 << 20


def start(name: str, flags: list[str]) -> ServerProcess:
    return ServerProcess(
        [*COMMON, "--max-total-tokens", str(L + 1024), *flags], log_path=RESULTS / f"chunk_cache_{name}.log"
    ).start()


def seed(hists: list[list[int]], root: Path) -> Path:
    d = root / "seed"
    srv = start("seed", ["--loopkv-tier-host-bytes", "0", "--loopkv-tier-disk-dir", str(d)])
    try:
        for hist in hists:
            timed_generate(srv.url, hist, 1)
    finally:
        srv.stop()
    return d


def run_system(name: str, flags: list[str], disk: Path | None, tok, hist, other, resumes: int, bar) -> dict:
    """``other``: another stored history, resumed once first: the server's first restore (thread starts,
    first-call costs) is not the measured history's, so resume 1 is only the cache's cold start."""
    srv = start(name, flags)
    runs = []
    filler = synthetic_ids(tok, FILLER, seed=20_000 + L)
    try:
        if disk is None:  # the ceiling: the histories in the host arena, out of the device pool
            for h in (hist, other):
                timed_generate(srv.url, h, 1)
            timed_generate(srv.url, filler, 1)
        if disk is not None:
            drop_page_cache(disk)
        timed_generate(srv.url, other + turn_ttft(tok, 99), 1)
        if name == "load_all":  # the filler's first prefill is stored (written to disk) once, here
            timed_generate(srv.url, filler, 1)
        time.sleep(2.0)  # the warm-up's write-through done: resume 1 does not share the disk with it
        for r in range(resumes):
            if name == "load_all":  # a full load leaves its history on the device: push it out
                timed_generate(srv.url, filler, 1)
            if disk is not None:
                drop_page_cache(disk)
            m0 = metrics(srv.url)
            res = timed_generate(srv.url, hist + turn_ttft(tok, r), 1)
            m1 = metrics_after(
                srv.url, m0, "loopkv_disk_bytes_read_total" if name == "load_all" else f'{P}{{part="loaded"}}'
            )
            d = res["meta_info"]["cached_tokens_details"]
            served = d["storage"] if disk is not None else d["host"]
            assert served >= L - CHUNK and d["device"] == 0, f"{name} resume {r}: served {d}"
            pruned = d.get("pruned") or {}
            disk_read = (
                pruned.get("disk_bytes_read", 0)
                if pruned
                else m1.get("loopkv_disk_bytes_read_total", 0.0) - m0.get("loopkv_disk_bytes_read_total", 0.0)
            )
            runs.append(
                {
                    "ttft_s": res["ttft_s"],
                    "disk_bytes_read": disk_read,
                    "bytes_loaded": pruned.get("bytes_loaded"),
                    "cached_bytes": pruned.get("cached_bytes", 0),
                    "chunk_cache_bytes": m1.get('loopkv_tier_bytes{tier="host_chunks"}', 0.0),
                    "served": d,
                }
            )
            bar.update()
    finally:
        srv.stop()
    warm = runs[1:]
    return {
        "flags": flags,
        "startup_s": srv.startup_s,
        "runs": runs,
        "cold_ttft_s": runs[0]["ttft_s"],
        "warm_ttft_s": median([x["ttft_s"] for x in warm]),
        "cold_disk_mb": runs[0]["disk_bytes_read"] / MB,
        "warm_disk_mb": median([x["disk_bytes_read"] for x in warm]) / MB,
        "warm_cached_share": median(
            [x["cached_bytes"] / x["bytes_loaded"] if x["bytes_loaded"] else 0.0 for x in warm]
        ),
        "chunk_cache_mb_end": runs[-1]["chunk_cache_bytes"] / MB,
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in res.items():
        xs = range(1, len(r["runs"]) + 1)
        a.plot(xs, [x["ttft_s"] for x in r["runs"]], marker="o", label=name)
        b.plot(xs, [x["disk_bytes_read"] / MB for x in r["runs"]], marker="o", label=name)
    a.set(xlabel="resume", ylabel="TTFT (s)", title=f"{L}-token history, budget {BUDGET}", ylim=(0, None))
    b.set(xlabel="resume", ylabel="disk MB read", title="disk reads per resume", ylim=(0, None))
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resumes", type=int, default=8)
    ap.add_argument("--host-mb", type=int, default=128, help="host arena of the disk systems (the history: ~190 MB)")
    ap.add_argument("--small-mb", type=int, default=12, help="the small arena (one resume reads ~19 MB)")
    args = ap.parse_args()
    mp = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mp)
    hist, other = synthetic_ids(tok, L, seed=HIST_SEED), synthetic_ids(tok, L, seed=HIST_SEED + 1)
    prune = ["--loopkv-prefix-budget", str(BUDGET)]
    systems = {
        "load_all": ([], args.host_mb, True),
        "pruned": ([*prune, "--loopkv-prefix-no-host-cache"], args.host_mb, True),
        "pruned+cache": (prune, args.host_mb, True),
        "pruned+cache-small": (prune, args.small_mb, True),
        "pruned-host": (prune, None, False),
    }
    res = {}
    with (
        tempfile.TemporaryDirectory(prefix="chunk_cache") as tmp,
        tqdm(total=len(systems) * args.resumes + 1, desc="chunk cache", unit="resume") as bar,
    ):
        root = Path(tmp)
        bar.set_postfix_str("seed")
        seed_dir = seed([hist, other], root)
        bar.update()
        for name, (extra, host_mb, on_disk) in systems.items():
            bar.set_postfix_str(name)
            disk = clone_dir(seed_dir, root / name) if on_disk else None
            flags = [*extra]
            if on_disk:
                flags += ["--loopkv-tier-host-bytes", str(host_mb * MB), "--loopkv-tier-disk-dir", str(disk)]
            res[name] = run_system(name, flags, disk, tok, hist, other, args.resumes, bar) | {"host_mb": host_mb}
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    summary = {
        "ttft_load_all_over_pruned_cache_warm": ratio(
            res["load_all"]["warm_ttft_s"], res["pruned+cache"]["warm_ttft_s"]
        ),
        "ttft_pruned_over_pruned_cache_warm": ratio(res["pruned"]["warm_ttft_s"], res["pruned+cache"]["warm_ttft_s"]),
        "ttft_pruned_cache_warm_over_host": ratio(
            res["pruned+cache"]["warm_ttft_s"], res["pruned-host"]["warm_ttft_s"]
        ),
        "disk_read_pruned_over_pruned_cache_warm": ratio(
            res["pruned"]["warm_disk_mb"], res["pruned+cache"]["warm_disk_mb"]
        ),
        "warm_cached_share": res["pruned+cache"]["warm_cached_share"],
        "warm_cached_share_small": res["pruned+cache-small"]["warm_cached_share"],
    }
    payload = {"environment": environment(), "history_tokens": L, "budget": BUDGET, "systems": res, "summary": summary}
    rows = [
        [
            name,
            "-" if r["host_mb"] is None else r["host_mb"],
            r["cold_ttft_s"],
            r["warm_ttft_s"],
            r["cold_disk_mb"],
            r["warm_disk_mb"],
            r["warm_cached_share"],
            r["chunk_cache_mb_end"],
        ]
        for name, r in res.items()
    ]
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    md = (
        f"# host chunk cache ({payload['environment']['when']}; `python -m benchmarks.studies.chunk_cache`)\n\n"
        f"SmolLM2-135M-Instruct, float32 KV pool, {machine_label()}. A {L}-token history stored on disk, "
        f"{args.resumes} returning turns (a different question each, segment files dropped from the page cache "
        f"before each); host arena {args.host_mb} MB (`pruned+cache-small`: {args.small_mb} MB), smaller than "
        f"the history, so a full load is never promoted. Budget {BUDGET} for the pruned systems. Resume 1 is "
        "cold; `warm` = median of the others.\n\n"
        + md_table(
            [
                "system",
                "host arena MB",
                "TTFT resume 1 s",
                "TTFT warm s",
                "disk MB read, resume 1",
                "disk MB read, warm",
                "loaded from the chunk cache, warm",
                "chunk cache MB at the end",
            ],
            rows,
        )
        + f"\nWarm TTFT: load_all / pruned+cache {fmt(summary['ttft_load_all_over_pruned_cache_warm'])}, "
        f"pruned / pruned+cache {fmt(summary['ttft_pruned_over_pruned_cache_warm'])}, pruned+cache / pruned-host "
        f"{fmt(summary['ttft_pruned_cache_warm_over_host'])}; disk read pruned / pruned+cache "
        + (
            fmt(summary["disk_read_pruned_over_pruned_cache_warm"])
            if summary["disk_read_pruned_over_pruned_cache_warm"] is not None
            else "- (pruned+cache read nothing from disk when warm)"
        )
        + ".\n\n![chunk cache](chunk_cache.png)\n"
    )
    write_results("chunk_cache", payload, md)
    plot(res, RESULTS / "chunk_cache.png")
    print(md)


if __name__ == "__main__":
    main()
