"""Sparse decode attention on a CUDA GPU, attention only, one layer: dense paged decode vs the
sparse decode executors (the Triton kernel, FlashInfer's paged decode driven by per-(sequence, KV
head) lists) at the server's page geometry.

Each of ``B`` sequences holds ``L`` tokens in one pool ([B * L, Hkv, D], sequence b at slots
b*L ..). A KV head's list is what the ``lserve`` policy's plan has the shape of: the sink page, the
local window and the rest of ``budget`` tokens as random distinct pages of 64 tokens (in position
order); selection itself is not timed (it runs once per ``--loopkv-decode-reuse`` steps, and its
cost is reported by ``benchmarks/decode_sparse.py`` on the CPU). Dense: FlashInfer's batch paged
decode over every slot with pages of one token (SGLang's FlashInfer backend layout) and the Triton
kernel with every slot listed (its 100% budget).

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed), median. ``fi_sparse`` runs a
prepared plan; ``+plan`` adds the page ids and FlashInfer's ``plan()``, which a server pays per
layer (the lists differ per layer); the Triton kernel needs no plan. Errors are relative to the
float64 reference (``sparse_decode_reference``) over the first two sequences. Writes
``<out>/gpu_decode.json`` (top-level ``summary``) and ``<out>/gpu_decode.md``.

    python -m benchmarks.gpu_decode [--batches 1 8 32] [--lengths 8192 32768] [--budgets 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.gpu_sparse import bench, rel, run_header

RESULTS = Path(__file__).resolve().parent / "results"
PAGE, SINK, LOCAL = 64, 64, 128  # the server's --loopkv-decode-page-size / -sink / -local defaults
GEOMETRIES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # (q heads, KV heads, head dim)


def head_lists(g: torch.Generator, B: int, H: int, L: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """head_indptr [B*H+1], head_slots: per (sequence, KV head) the sink, the local window and random
    distinct middle pages of PAGE tokens up to ``budget`` tokens, ascending slots of sequence b."""
    pages = L // PAGE
    first, last = SINK // PAGE, pages - LOCAL // PAGE  # middle pages [first, last)
    pick = max(0, min(last - first, (budget - SINK - LOCAL) // PAGE))
    lens, slots = [], []
    for b in range(B):
        for _ in range(H):
            mid = first + torch.randperm(last - first, generator=g)[:pick]
            chosen = torch.cat([torch.arange(first), mid.sort().values, torch.arange(last, pages)])
            s = (chosen[:, None] * PAGE + torch.arange(PAGE)).flatten() + b * L
            lens.append(s.numel())
            slots.append(s)
    return torch.tensor([0, *lens]).cumsum(0), torch.cat(slots)


def run_case(geometry: str, B: int, L: int, budget: int, dtype, rep_ms: float, fi_sparse, fi_dense) -> dict:
    from sgl_loopkv.attention.decode_gpu import sparse_decode_reference
    from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton

    Hq, H, D = GEOMETRIES[geometry]
    scale, G = D**-0.5, Hq // H
    g = torch.Generator().manual_seed(B * 7 + L + budget)
    dev = "cuda"
    q = torch.randn(B, Hq, D, device=dev, dtype=dtype)
    k = torch.randn(B * L, H, D, device=dev, dtype=dtype)
    v = torch.randn(B * L, H, D, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    indptr, slots = head_lists(g, B, H, L, budget)
    d_indptr, d_slots = indptr.to(dev), slots.to(dev)
    keys = int(indptr[-1]) // (B * H)
    all_indptr = torch.arange(B * H + 1, dtype=torch.int64) * L
    all_slots = (torch.arange(B)[:, None, None] * L + torch.arange(L)).expand(B, H, L).flatten()
    d_all_indptr, d_all_slots = all_indptr.to(dev), all_slots.to(dev)

    row = {
        "geometry": geometry,
        "batch": B,
        "tokens": L,
        "budget": budget,
        "keys_per_head": keys,
        "dtype": str(dtype).removeprefix("torch."),
    }
    # dense: FlashInfer batch paged decode, pages of one token over [B*L, H, D] (SGLang's layout)
    fi_dense.plan(
        torch.arange(B + 1, dtype=torch.int32) * L,
        torch.arange(B * L, dtype=torch.int32, device=dev),
        torch.ones(B, dtype=torch.int32),
        Hq,
        H,
        D,
        1,
        sm_scale=scale,
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    kv_pages = (k.view(-1, 1, H, D), v.view(-1, 1, H, D))
    row["fi_dense"] = bench(lambda: fi_dense.run(q, kv_pages, out=out), rep_ms)
    dense_out = out.clone()
    fp32 = dict(tensor_cores=False)  # the kernel's fp32-product path ("triton"; the tensor-core one: "triton_tc")
    row["triton_dense"] = bench(
        lambda: sparse_decode_triton(q, k, v, d_all_indptr, d_all_slots, scale, out, **fp32), rep_ms
    )
    row["err_triton_dense_vs_fi_dense"] = rel(out, dense_out)
    # sparse
    row["triton"] = bench(lambda: sparse_decode_triton(q, k, v, d_indptr, d_slots, scale, out, **fp32), rep_ms)
    nb = min(B, 2)  # the float64 reference over the first sequences (their slots are < nb * L)
    n_ref = int(indptr[nb * H])
    ref_q = q[:nb].double()
    ref = sparse_decode_reference(
        ref_q, k[: nb * L].double(), v[: nb * L].double(), d_indptr[: nb * H + 1], d_slots[:n_ref], scale, ref_q.clone()
    )
    row["err_triton"] = rel(out[:nb], ref)
    if dtype != torch.float32:  # the kernel's tensor-core path (half K/V straight into tl.dot)
        row["triton_tc"] = bench(
            lambda: sparse_decode_triton(q, k, v, d_indptr, d_slots, scale, out, tensor_cores=True), rep_ms
        )
        row["err_triton_tc"] = rel(out[:nb], ref)
        row["triton_tc_dense"] = bench(
            lambda: sparse_decode_triton(q, k, v, d_all_indptr, d_all_slots, scale, out, tensor_cores=True), rep_ms
        )
        fi_sparse.plan(indptr, d_slots, H, G, D, scale, dtype)
        row["fi_sparse"] = bench(lambda: fi_sparse.run(q, k, v, out), rep_ms)
        row["err_fi_sparse"] = rel(out[:nb], ref)
        row["fi_sparse_plan"] = bench(lambda: fi_sparse(q, k, v, indptr, d_slots, scale, out), rep_ms)
    fastest_dense = min(row["fi_dense"], row["triton_dense"])
    row["speedup_triton"] = fastest_dense / row["triton"]
    if "triton_tc" in row:
        row["speedup_triton_tc"] = fastest_dense / row["triton_tc"]
    if "fi_sparse" in row:
        row["speedup_fi_sparse"] = fastest_dense / row["fi_sparse"]
        row["speedup_fi_sparse_plan"] = fastest_dense / row["fi_sparse_plan"]
    return row


def summarize(rows: list[dict]) -> dict:
    def med(key, **where):
        xs = [r[key] for r in rows if key in r and all(r[k] == v for k, v in where.items())]
        return statistics.median(xs) if xs else None

    return {
        "median_speedup_triton": med("speedup_triton"),
        "median_speedup_triton_tc": med("speedup_triton_tc"),
        "median_triton_over_triton_tc": statistics.median(
            r["triton"] / r["triton_tc"] for r in rows if "triton_tc" in r
        )
        if any("triton_tc" in r for r in rows)
        else None,
        "median_speedup_fi_sparse": med("speedup_fi_sparse"),
        "median_speedup_fi_sparse_plan": med("speedup_fi_sparse_plan"),
        "median_speedup_triton_32k_budget_1024": med("speedup_triton", tokens=32768, budget=1024),
        "max_err_triton": max(r["err_triton"] for r in rows),
        "max_err_triton_tc": max((r["err_triton_tc"] for r in rows if "err_triton_tc" in r), default=None),
        "max_err_fi_sparse": max((r["err_fi_sparse"] for r in rows if "err_fi_sparse" in r), default=None),
        "max_err_triton_dense_vs_fi_dense": max(r["err_triton_dense_vs_fi_dense"] for r in rows),
    }


def markdown(payload: dict) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [
        f"# gpu_decode ({payload['when']}; `python -m benchmarks.gpu_decode`)",
        "",
        f"{payload['device']}, torch {payload['torch']}, triton {payload['triton']}, flashinfer "
        f"{payload['flashinfer']}. Attention only, one decode step of one layer: B sequences of L tokens, a "
        f"list per (sequence, KV head) of `budget` tokens (sink {SINK}, local {LOCAL}, random middle pages of "
        f"{PAGE}); median ms of `triton.testing.do_bench` (L2 flushed). `fi_dense` = FlashInfer batch paged "
        "decode over every token (pages of one token, SGLang's FlashInfer layout); `triton_dense` = the sparse "
        "Triton kernel with every slot listed (`tc`: on its tensor-core path); `triton` = the kernel over the "
        "lists (fp32 products), `triton_tc` = the same on its tensor-core path; `fi_sparse` = "
        "FlashInferSparseDecode.run after plan(), `+plan` = plan() + run per layer (the lists differ per layer). "
        "Speedup = fastest dense / sparse. Errors: relative to the float64 reference.",
        "",
        "| geometry (Hq/Hkv/D) | B | tokens | budget | dtype | fi_dense | triton_dense (tc) | triton | triton_tc "
        "| fi_sparse (+plan) | speedup triton | speedup triton_tc | speedup fi_sparse (+plan) | err triton | "
        "err triton_tc | err fi_sparse |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        hq, h, d = GEOMETRIES[r["geometry"]]
        fi = f"{fmt(r.get('fi_sparse'))} ({fmt(r.get('fi_sparse_plan'))})"
        sp = f"{fmt(r.get('speedup_fi_sparse'))} ({fmt(r.get('speedup_fi_sparse_plan'))})"
        err = lambda key, r=r: "-" if r.get(key) is None else f"{r[key]:.1e}"  # noqa: E731
        lines.append(
            f"| {r['geometry']} ({hq}/{h}/{d}) | {r['batch']} | {r['tokens']} | {r['budget']} | {r['dtype']} | "
            f"{fmt(r['fi_dense'])} | {fmt(r['triton_dense'])} ({fmt(r.get('triton_tc_dense'))}) | "
            f"{fmt(r['triton'])} | {fmt(r.get('triton_tc'))} | {fi} | {r['speedup_triton']:.2f} | "
            f"{fmt(r.get('speedup_triton_tc'))} | {sp} | {err('err_triton')} | {err('err_triton_tc')} | "
            f"{err('err_fi_sparse')} |"
        )
    s = payload["summary"]
    lines += ["", "Summary: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items())]
    return "\n".join(lines) + "\n"


def save(args, rows: list[dict]) -> str:
    payload = {"summary": summarize(rows), **run_header(args), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = markdown(payload)
    (args.out / "gpu_decode.md").write_text(md)
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    ap.add_argument("--rep-ms", type=float, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode needs CUDA")
    import flashinfer

    from sgl_loopkv.attention.decode_gpu import FlashInferSparseDecode

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fi_sparse = FlashInferSparseDecode()
    rows = []
    for geometry in args.geometries:
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            Hq, H, _ = GEOMETRIES[geometry]
            tc = Hq // H not in FlashInferSparseDecode.DECODE_GROUPS
            fi_dense = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            for L in args.lengths:
                for B in args.batches:
                    for budget in args.budgets:
                        try:
                            r = run_case(geometry, B, L, budget, dtype, args.rep_ms, fi_sparse, fi_dense)
                        except Exception as e:  # report and go on: one shape's failure keeps the others' rows
                            print("FAILED", geometry, B, L, budget, dt, repr(e), flush=True)
                            continue
                        rows.append(r)
                        torch.cuda.empty_cache()
                        save(args, rows)  # after every case: a run cut short still leaves its rows
                        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print(save(args, rows))


if __name__ == "__main__":
    main()
