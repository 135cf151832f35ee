"""What encryption at rest (``--loopkv-disk-key-file``) costs a disk read, without a server.

SmolLM2-135M's KV geometry (30 layers, 3 KV heads x 64), one 4K-token segment per store dtype
(float32, int8), written plain and sealed; each timed read drops the file from the page cache
first (``POSIX_FADV_DONTNEED``) and reads the whole segment verified (a full-history disk load:
the most bytes a resume decrypts). Plain and sealed reads alternate, so drift hits both; medians.
The server-level number (TTFT of a 4K disk resume) is ``benchmarks.restore``'s
``summary.encrypted_over_plain_disk_resume_4k``.

    python -m benchmarks.studies.disk_cipher           # ~1 minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk import DiskSegmentStore, SegmentRecord
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.packed import quantize_rows

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
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
