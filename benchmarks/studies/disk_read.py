"""Disk resumes read inline vs read ahead (``--loopkv-tier-disk-read inline|background``), side by side;
the read-ahead thread as it runs by default (nice 10, paced: it naps between pieces of the read while
other requests run, :mod:`sgl_loopkv.cache.read_pacing`), niced but not paced (``background-unpaced``:
``LOOPKV_READ_AHEAD_PACED=0``) and at normal priority, not paced (``background-normal``: both off).

SmolLM2, three 3K-token histories on the disk tier only (``--loopkv-tier-host-bytes 0``, a device pool
that holds one), the page cache dropped before each resume. Under load: client A resumes them back
to back while client B streams three 150-token answers; B's inter-token gaps and A's TTFT. Idle:
A alone, 15 resumes. The modes alternate (inline, background, inline, ...) so drift hits both.

    python -m benchmarks.studies.disk_read            # 2 servers per mode and load (~25 minutes)
    python -m benchmarks.studies.disk_read --pairs 1  # one of each (~13 minutes)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
from transformers import AutoTokenizer

from benchmarks.common import synthetic_ids, timed_generate
from benchmarks.harness.env import environment, finish
from benchmarks.harness.results import md_table
from benchmarks.studies import RESULTS, write_results
from benchmarks.studies.resume import drop_page_cache
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import ensure_default_model
from sgl_loopkv.server.process import ServerProcess

L, N_HIST, ANSWER = 3072, 3, 150
MODE_ENV = {  # the read-ahead modes: the server's environment
    "background": {},
    "background-unpaced": {"LOOPKV_READ_AHEAD_PACED": "0"},
    "background-normal": {"LOOPKV_READ_AHEAD_PACED": "0", "LOOPKV_READ_AHEAD_NICE": "0"},
}
MODES = ("inline", *MODE_ENV)


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run(mode: str, tok, idle: bool) -> dict:
    hists = [synthetic_ids(tok, L, seed=70 + i) for i in range(N_HIST)]
    disk = Path(tempfile.mkdtemp(prefix="disk-read-"))
    flags = ["--max-total-tokens", str(L + 1200), "--loopkv-tier-host-bytes", "0", "--loopkv-tier-disk-dir", str(disk)]
    flags += ["--loopkv-weights", "float32"]  # the float32 conversion: what the committed results measured
    read, env = ("inline", {}) if mode == "inline" else ("background", MODE_ENV[mode])
    srv = ServerProcess(
        [*flags, "--loopkv-tier-disk-read", read], env=env, log_path=RESULTS / f"disk_read_{mode}.log"
    ).start()
    try:
        for h in hists:
            timed_generate(srv.url, h, 1)
        time.sleep(1.0)  # the writer puts them on disk
        ttfts: list[float] = []

        def resume(r: int) -> None:
            drop_page_cache(disk)
            res = timed_generate(srv.url, hists[r % N_HIST] + synthetic_ids(tok, 12, seed=5000 + r), 1)
            assert (res["meta_info"].get("cached_tokens_details") or {}).get("storage", 0) >= L - 16, res["meta_info"]
            ttfts.append(res["ttft_s"])

        if idle:
            for r in range(15):
                resume(r)
            return {"mode": mode, "load": "idle", "resumes": len(ttfts), "ttft_p50_s": statistics.median(ttfts)}
        gaps, stop = [], threading.Event()

        def resumer() -> None:
            r = 0
            while not stop.is_set():
                resume(r)
                r += 1

        th = threading.Thread(target=resumer)
        th.start()
        try:
            for rep in range(3):
                body = {
                    "input_ids": synthetic_ids(tok, 64, seed=9100 + rep),
                    "sampling_params": {"max_new_tokens": ANSWER, "temperature": 0, "ignore_eos": True},
                    "stream": True,
                }
                last = None
                with requests.post(f"{srv.url}/generate", json=body, stream=True, timeout=600) as resp:
                    for line in resp.iter_lines():
                        if line.startswith(b"data:") and not line.endswith(b"[DONE]"):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
        finally:
            stop.set()
            th.join()
        return {
            "mode": mode,
            "load": "a stream beside",
            "resumes": len(ttfts),
            "ttft_p50_s": statistics.median(ttfts),
            "stream_gap_p50_ms": 1000 * quantile(gaps, 0.5),
            "stream_gap_p99_ms": 1000 * quantile(gaps, 0.99),
            "stream_gap_max_ms": 1000 * max(gaps),
        }
    finally:
        srv.stop()


def median_of(rows: list[dict], mode: str, load: str, key: str) -> float:
    return statistics.median(r[key] for r in rows if r["mode"] == mode and r["load"] == load)


def summarize(rows: list[dict]) -> dict:
    """Ratios of the medians (with a stream beside unless named idle); > 1: the first is larger."""
    med = functools.partial(median_of, rows)
    busy = "a stream beside"
    out = {
        "stream_gap_p50_inline_over_background": med("inline", busy, "stream_gap_p50_ms") / med("background", busy, "stream_gap_p50_ms"),
        "ttft_p50_background_over_inline": med("background", busy, "ttft_p50_s") / med("inline", busy, "ttft_p50_s"),
    }  # fmt: skip
    niced = "background-unpaced" if any(r["mode"] == "background-unpaced" for r in rows) else "background"
    if any(r["mode"] == "background-normal" for r in rows):  # both not paced (a run before pacing: niced = background)
        for key in ("stream_gap_p50_ms", "stream_gap_p99_ms", "stream_gap_max_ms", "ttft_p50_s"):
            out[f"{key}_normal_over_niced"] = med("background-normal", busy, key) / med(niced, busy, key)
        out["ttft_p50_s_normal_over_niced_idle"] = med("background-normal", "idle", "ttft_p50_s") / med(
            niced, "idle", "ttft_p50_s"
        )
    if niced == "background-unpaced":
        for key in ("stream_gap_p50_ms", "stream_gap_p99_ms", "stream_gap_max_ms", "ttft_p50_s"):
            out[f"{key}_unpaced_over_paced"] = med(niced, busy, key) / med("background", busy, key)
        out["ttft_p50_s_unpaced_over_paced_idle"] = med(niced, "idle", "ttft_p50_s") / med(
            "background", "idle", "ttft_p50_s"
        )
    return out


def report(rows: list[dict], when: str) -> str:
    keys = ["mode", "load", "resumes", "ttft_p50_s", "stream_gap_p50_ms", "stream_gap_p99_ms", "stream_gap_max_ms"]
    md = f"# disk_read ({when}; `python -m benchmarks.studies.disk_read`)\n\n"
    md += "A disk-only 3K-token history resumed (page cache dropped): inline read vs read ahead.\n\n"
    md += md_table(keys, [[r.get(k, "-") for k in keys] for r in rows])
    med = functools.partial(median_of, rows)
    busy, idle = "a stream beside", "idle"
    md += (
        f"\nWith a stream beside: its inter-token gap p50 inline / background "
        f"**{med('inline', busy, 'stream_gap_p50_ms') / med('background', busy, 'stream_gap_p50_ms'):.2f}x**, p99 "
        f"**{med('inline', busy, 'stream_gap_p99_ms') / med('background', busy, 'stream_gap_p99_ms'):.2f}x**; "
        f"the resuming client's TTFT p50 background / inline "
        f"**{med('background', busy, 'ttft_p50_s') / med('inline', busy, 'ttft_p50_s'):.2f}x**. "
        f"Idle: TTFT p50 background / inline **{med('background', idle, 'ttft_p50_s') / med('inline', idle, 'ttft_p50_s'):.2f}x**.\n"
    )
    s = summarize(rows)
    if "stream_gap_p50_ms_normal_over_niced" in s:
        md += (
            f"\nThe read-ahead thread at normal priority / at nice 10 (neither paced), with a stream beside: the "
            f"stream's gap p50 **{s['stream_gap_p50_ms_normal_over_niced']:.2f}x**, p99 "
            f"**{s['stream_gap_p99_ms_normal_over_niced']:.2f}x**; the resuming client's TTFT p50 "
            f"**{s['ttft_p50_s_normal_over_niced']:.2f}x**; idle: TTFT p50 **{s['ttft_p50_s_normal_over_niced_idle']:.2f}x**.\n"
        )
    if "stream_gap_p50_ms_unpaced_over_paced" in s:
        md += (
            f"\nNot paced / paced (both at nice 10), with a stream beside: the stream's gap p50 "
            f"**{s['stream_gap_p50_ms_unpaced_over_paced']:.2f}x**, p99 **{s['stream_gap_p99_ms_unpaced_over_paced']:.2f}x**, "
            f"max **{s['stream_gap_max_ms_unpaced_over_paced']:.2f}x**; the resuming client's TTFT p50 "
            f"**{s['ttft_p50_s_unpaced_over_paced']:.2f}x**; idle: TTFT p50 **{s['ttft_p50_s_unpaced_over_paced_idle']:.2f}x**.\n"
        )
    return md


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = functools.partial(median_of, rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    busy = "a stream beside"
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    w = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        axes[0].bar([j + w * i for j in range(2)], [med(mode, busy, "stream_gap_p50_ms"), med(mode, busy, "stream_gap_p99_ms")],
                    width=w, label=mode)  # fmt: skip
        axes[1].bar([j + w * i for j in range(2)], [med(mode, busy, "ttft_p50_s"), med(mode, "idle", "ttft_p50_s")],
                    width=w, label=mode)  # fmt: skip
    axes[0].set_xticks([0.4 - w / 2, 1.4 - w / 2], ["gap p50", "gap p99"])
    axes[0].set_ylabel("ms")
    axes[0].set_title("a stream beside disk resumes")
    axes[1].set_xticks([0.4 - w / 2, 1.4 - w / 2], ["under load", "idle"])
    axes[1].set_ylabel("s")
    axes[1].set_title("the resuming client's TTFT p50")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="runs of each mode per load (default 2)")
    ap.add_argument("--report-only", action="store_true", help="the table again from disk_read.json")
    args = ap.parse_args()
    if args.report_only:
        payload = json.loads((RESULTS / "disk_read.json").read_text())
    else:
        env = environment()
        tok = AutoTokenizer.from_pretrained(ensure_default_model(LoopKVConfig().resolved_cache_dir))
        rows = [run(m, tok, idle) for idle in (False, True) for _ in range(args.pairs) for m in MODES]
        payload = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows, "environment": finish(env)}
    payload["summary"] = summarize(payload["rows"])
    md = report(payload["rows"], payload.get("when", "see the JSON"))
    write_results("disk_read", payload, md + "\n![disk_read](disk_read.png)\n")
    plot(payload["rows"], RESULTS / "disk_read.png")
    print(md)


if __name__ == "__main__":
    main()
