"""Whole disk reads into fresh memory vs into memory an earlier read touched (:mod:`sgl_loopkv.cache.read_buffers`).

One history of the default model's geometry (30 layers, 3 KV heads of 64) stored as a segment file,
int8 (the headline system's tier) and bfloat16, plain and sealed; each read whole through the disk
store the server uses (native reads), its rows dropped after it as a resume that loads them into the
pool drops them. ``fresh``: the codec's buffers keep nothing (``ReadBuffers(keep_bytes=0)``: every
read's rows are new pages, as before the buffers); ``reused``: the default. ``cold``: the file dropped
from the page cache before the read; ``cached``: read again at once. The two alternate, read by read.

    python -m benchmarks.studies.read_buffers               # ~2 minutes
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.harness.env import environment, finish, machine_label
from benchmarks.harness.results import md_table
from benchmarks.studies import RESULTS, write_results
from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.cache.read_buffers import ReadBuffers
from sgl_loopkv.cache.segment_record import SegmentRecord

LAYERS, HKV, D, C = 30, 3, 64, 16
DTYPES = {"int8": torch.int8, "bfloat16": torch.bfloat16}
MODES = ("fresh", "reused")


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def case(tokens: int, dtype: str, sealed: bool, repeats: int) -> dict:
    geo = KVGeometry(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, dtype=DTYPES[dtype], chunk_tokens=C)
    root = Path(tempfile.mkdtemp(prefix="loopkv-read-buffers-"))
    try:
        cipher = SegmentCipher(os.urandom(32)) if sealed else None
        store = DiskSegmentStore(root, 1 << 40, geo, cipher=cipher)
        x = torch.randn(LAYERS, 2, tokens, HKV, D, generator=torch.Generator().manual_seed(tokens))
        kv = QuantKV.quantize(x) if dtype == "int8" else x.to(torch.bfloat16)
        n = tokens // C
        store.write(SegmentRecord("s", None, 0, n, 0), kv, key_summaries(x[:, 0], C))
        path = next(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
        buffers = {"fresh": ReadBuffers(keep_bytes=0), "reused": store.codec.buffers}
        times = {(m, t): [] for m in MODES for t in ("cold", "cached")}
        for _ in range(repeats):
            for m in MODES:
                store.codec.buffers = buffers[m]
                drop_cache(path)
                for temp in ("cold", "cached"):
                    t0 = time.perf_counter()
                    rows = store.read("s", 0, n)
                    times[(m, temp)].append(time.perf_counter() - t0)
                    del rows  # loaded and dropped, as a resume without a host arena does
        row = {
            "tokens": tokens,
            "dtype": dtype,
            "file": "sealed" if sealed else "plain",
            "mb": path.stat().st_size / 1e6,
        }
        for (m, temp), ts in times.items():
            row[f"{m}_{temp}_ms"] = 1000 * statistics.median(ts)
        for temp in ("cold", "cached"):
            row[f"fresh_over_reused_{temp}"] = row[f"fresh_{temp}_ms"] / row[f"reused_{temp}_ms"]
        return row
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(rows: list[dict]) -> dict:
    cold = [r["fresh_over_reused_cold"] for r in rows]
    cached = [r["fresh_over_reused_cached"] for r in rows]
    at = {(r["tokens"], r["dtype"], r["file"]): r for r in rows}
    head = at.get((4096, "int8", "plain"), rows[0])
    return {
        "fresh_over_reused_cold_min": min(cold),
        "fresh_over_reused_cold_median": statistics.median(cold),
        "fresh_over_reused_cached_median": statistics.median(cached),
        "int8_4k_plain_cold_ms": {m: head[f"{m}_cold_ms"] for m in MODES},
        "int8_4k_plain_cached_ms": {m: head[f"{m}_cached_ms"] for m in MODES},
        "int8_4k_plain_saved_cold_ms": head["fresh_cold_ms"] - head["reused_cold_ms"],
    }


def report(payload: dict) -> str:
    env, rows, s = payload["environment"], payload["rows"], payload["summary"]
    head = ["tokens", "tier", "file", "MB", "fresh cold ms", "reused cold ms", "fresh / reused", "fresh cached ms"]
    head += ["reused cached ms", "fresh / reused (cached)"]
    table = [
        [
            r["tokens"],
            r["dtype"],
            r["file"],
            f"{r['mb']:.0f}",
            f"{r['fresh_cold_ms']:.1f}",
            f"{r['reused_cold_ms']:.1f}",
        ]
        + [f"{r['fresh_over_reused_cold']:.2f}x", f"{r['fresh_cached_ms']:.1f}", f"{r['reused_cached_ms']:.1f}"]
        + [f"{r['fresh_over_reused_cached']:.2f}x"]
        for r in rows
    ]
    return (
        f"# read_buffers ({env['when']}; `python -m benchmarks.studies.read_buffers`; {env.get('cpu_model')}, "
        f"{machine_label(env)})\n\n"
        "A whole read of one segment file through the disk store (native reads), its rows dropped after it; "
        "`fresh`: rows in new memory every read (`ReadBuffers(keep_bytes=0)`), `reused`: the codec's buffers "
        "(the default). Medians of "
        f"{payload['repeats']} reads each, the modes alternating; cold = the file dropped from the page cache.\n\n"
        + md_table(head, table)
        + f"\n\nfresh / reused, cold: median **{s['fresh_over_reused_cold_median']:.2f}x**, "
        f"min {s['fresh_over_reused_cold_min']:.2f}x; from the page cache: median "
        f"**{s['fresh_over_reused_cached_median']:.2f}x**. A 4K int8 plain read cold: "
        f"{s['int8_4k_plain_cold_ms']['fresh']:.1f} ms fresh, {s['int8_4k_plain_cold_ms']['reused']:.1f} ms reused.\n"
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    labels = [f"{r['tokens'] // 1024}K {r['dtype'][:4]} {r['file']}" for r in rows]
    x = range(len(rows))
    for b, m in enumerate(MODES):
        ax.bar([i + (b - 0.5) * 0.4 for i in x], [r[f"{m}_cold_ms"] for r in rows], width=0.4, label=f"{m} rows")
    ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per whole read (cold file)")
    ax.set_title("whole disk reads: rows in fresh vs reused memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8000])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    env = environment()
    cases = [(t, d, s) for t in args.tokens for d in DTYPES for s in (False, True)]
    rows = [case(t, d, s, args.repeats) for t, d, s in tqdm(cases, desc="read buffers")]
    payload = {"rows": rows, "repeats": args.repeats, "environment": finish(env)}
    payload["summary"] = summarize(rows)
    md = report(payload)
    write_results("read_buffers", payload, md + "\n![read_buffers](read_buffers.png)\n")
    plot(rows, RESULTS / "read_buffers.png")
    print(md)


if __name__ == "__main__":
    main()
