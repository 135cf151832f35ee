"""What encryption at rest (``--loopkv-lifecycle-disk-key-file``) costs a disk read, without a server.

SmolLM2-135M's KV geometry (30 layers, 3 KV heads x 64), one 4K-token segment per store dtype
(float32, int8), written plain and sealed; each timed read drops the file from the page cache
first (``POSIX_FADV_DONTNEED``) and reads the whole segment verified (a full-history disk load:
the most bytes a resume decrypts). Plain and sealed reads alternate, so drift hits both; medians.
``--server``: the same at server level, two SmolLM2 servers up together (the restore benchmark's
headline config, int8 tiers and the krul planner, disk tier only), one plain and one with
``--loopkv-lifecycle-disk-key-file``, their 4K disk resumes alternated (TTFT of a 1-token answer, the page cache
dropped first), so load on a shared machine hits both alike. ``benchmarks.restore`` reports the same
ratio as ``summary.encrypted_over_plain_disk_resume_4k`` (one server after the other).

    python -m benchmarks.studies.disk_cipher           # ~1 minute
    python -m benchmarks.studies.disk_cipher --server  # ~5-10 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.env import environment
from benchmarks.studies import write_results
from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk import DiskSegmentStore
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.packed import quantize_rows
from sgl_loopkv.cache.segment_record import SegmentRecord

LAYERS, HEADS, DIM, CHUNK = 30, 3, 64, 16


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(dtype: torch.dtype, tokens: int, repeats: int) -> dict:
    geo = KVGeometry(LAYERS, HEADS, DIM, dtype, CHUNK)
    kv = torch.randn(LAYERS, 2, tokens, HEADS, DIM)
    summ = key_summaries(kv[:, 0], CHUNK)
    rows = quantize_rows(kv) if dtype == torch.int8 else kv
    m = tokens // CHUNK
    rec = SegmentRecord("bench", None, 0, m, 0, token_ids=list(range(tokens)))
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {
            "plain": DiskSegmentStore(Path(tmp) / "plain", 1 << 34, geo),
            "sealed": DiskSegmentStore(Path(tmp) / "sealed", 1 << 34, geo, cipher=SegmentCipher(os.urandom(32))),
        }
        for name, store in stores.items():
            t0 = time.perf_counter()
            store.write(rec, rows, summ)
            out[f"write_s_{name}"] = time.perf_counter() - t0
        times: dict[str, list[float]] = {n: [] for n in stores}
        for _ in range(repeats):
            for name, store in stores.items():
                drop(store.path(rec.seg_id))
                t0 = time.perf_counter()
                store.read(rec.seg_id, 0, m)
                times[name].append(time.perf_counter() - t0)
        out |= {f"read_s_{n}": statistics.median(t) for n, t in times.items()}
        out["file_bytes"] = stores["plain"].path(rec.seg_id).stat().st_size
    out["sealed_over_plain_read"] = out["read_s_sealed"] / out["read_s_plain"]
    return out


def serve(tokens: int, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.common import drop_page_cache, synthetic_ids, timed_generate
    from benchmarks.restore import FILLER, SYSTEMS, WEIGHTS, key_file, turn_ids
    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import ensure_default_model
    from sgl_loopkv.server.process import ServerProcess

    tok = AutoTokenizer.from_pretrained(ensure_default_model(LoopKVConfig().resolved_cache_dir))
    hist = synthetic_ids(tok, tokens, seed=tokens)
    prompt = hist + turn_ids(tok)
    servers, dirs = {}, {}
    try:
        for name in ("plain", "encrypted"):
            dirs[name] = Path(tempfile.mkdtemp(prefix=f"loopkv-cipher-{name}-"))
            flags = [key_file() if f == "{key}" else f for f in SYSTEMS["loopkv_encrypted"][0]]
            if name == "plain":
                flags = flags[: flags.index("--loopkv-lifecycle-disk-key-file")]
            args = ["--max-total-tokens", str(tokens + 1024), "--loopkv-tier-host-bytes", "0"]
            args += ["--loopkv-tier-disk-dir", str(dirs[name]), *flags, *WEIGHTS]  # the float32 conversion (restore.py)
            servers[name] = ServerProcess(args).start()
            timed_generate(servers[name].url, hist, 1)  # the earlier turn: now stored
        ttft: dict[str, list[float]] = {n: [] for n in servers}
        for r in range(repeats + 1):  # the first round warms up
            for name, srv in servers.items():
                timed_generate(srv.url, synthetic_ids(tok, FILLER, seed=10_000 + r), 1)  # evicts the history
                drop_page_cache(dirs[name])
                res = timed_generate(srv.url, prompt, 1)
                assert res["meta_info"]["cached_tokens_details"]["storage"] >= tokens - 16, res["meta_info"]
                if r:
                    ttft[name].append(res["ttft_s"])
    finally:
        for srv in servers.values():
            srv.stop()
    out = {f"ttft_s_{n}": statistics.median(t) for n, t in ttft.items()} | {"ttfts_s": ttft}
    out["encrypted_over_plain_disk_resume"] = out["ttft_s_encrypted"] / out["ttft_s_plain"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--server", action="store_true", help="TTFT of disk resumes on two servers, alternated")
    args = ap.parse_args()
    if args.server:
        r = serve(args.tokens, args.repeats)
        md = (
            f"# Encrypted vs plain disk resume (SmolLM2, int8 tiers, {args.tokens}-token history)\n\n"
            f"TTFT, median of {args.repeats} alternated resumes with the page cache dropped: plain "
            f"{r['ttft_s_plain']:.3f} s, encrypted {r['ttft_s_encrypted']:.3f} s: "
            f"**{r['encrypted_over_plain_disk_resume']:.3f}x**. All TTFTs: {r['ttfts_s']}\n"
        )
        summary = {"encrypted_over_plain_disk_resume": r["encrypted_over_plain_disk_resume"], "tokens": args.tokens}
        payload = {"config": vars(args), "systems": r, "summary": summary, "environment": environment()}
        write_results("disk_cipher", payload, md)
        print(md)
        return
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.int8):
        r = measure(dtype, args.tokens, args.repeats)
        print(
            f"{str(dtype).removeprefix('torch.'):8s} {r['file_bytes'] / 1e6:6.1f} MB: read plain {r['read_s_plain'] * 1e3:6.1f}"
            f" ms, sealed {r['read_s_sealed'] * 1e3:6.1f} ms ({r['sealed_over_plain_read']:.2f}x); write plain"
            f" {r['write_s_plain'] * 1e3:.0f} ms, sealed {r['write_s_sealed'] * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
