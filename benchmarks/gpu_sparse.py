"""Sparse-prefill attention on a CUDA GPU, attention only: dense (torch SDPA as the dense executor
calls it, FlashInfer dense) vs the Triton block-sparse kernel vs the FlashInfer sparse executor.

SmolLM2-like geometry: 9 query heads, 3 KV heads, head dim 64, one sequence of ``L`` new tokens
(no cached prefix), fp16 and bf16. Plans come from the ``loopserve`` policy at the server's
defaults (dense tail 64, 16 tail samples, full-head density 0.6), run on synthetic *structured* q/k
(a drifting per-head content direction, so nearby tokens attend to each other: slash lines; a
few sink and scattered keys every query leans towards: vertical lines); ``--loopkv-prefill-alpha`` is
bisected per length until the plan's density is near each target. Selection runs on the CPU (fp32)
and is not timed.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls), median of every
call in ``--rep-ms``. "kernel" times run a prepared plan (Triton: index tensors on the GPU;
FlashInfer: ``plan()`` done); "+plan" times include the per-layer host work (Triton: building
and uploading the index tensors; FlashInfer: building the requests and ``plan()``), which a
server pays once per layer. Writes ``<out>/gpu_sparse.json`` (top-level ``summary``) and
``<out>/gpu_sparse.md``.

    python -m benchmarks.gpu_sparse [--lengths 8192 32768] [--densities 0.1 0.3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, D, BLOCK = 9, 3, 64, 64
SCALE = D**-0.5


def structured_qk(L: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 CPU q [L, HQ, D], k [L, HKV, D] with local (slash) and vertical attention structure."""
    g = torch.Generator().manual_seed(seed)
    walk = torch.randn(L, HKV, D, generator=g).cumsum(0)  # random walk minus its moving average:
    trend = torch.nn.functional.avg_pool1d(walk.permute(1, 2, 0), 257, 1, 128, count_include_pad=False)
    walk = walk - trend.permute(2, 0, 1)  # a direction that drifts over ~100s of tokens
    walk = walk / walk.norm(dim=-1, keepdim=True) * 8
    sink = torch.randn(HKV, D, generator=g)
    sink = sink / sink.norm(dim=-1, keepdim=True) * 8
    k = torch.randn(L, HKV, D, generator=g) + walk
    k[torch.cat([torch.arange(4), torch.randint(0, L, (L // 512,), generator=g)])] += sink
    G = HQ // HKV
    q = torch.randn(L, HQ, D, generator=g) + walk.repeat_interleave(G, 1) + 0.5 * sink.repeat_interleave(G, 0)
    return q, k


def plan_at_density(q, k, target: float, steps: int = 7):
    """loopserve at the server defaults, alpha bisected towards ``target`` density."""
    from sgl_loopkv.attention.policies.loopserve import VerticalSlashPolicy

    lo, hi, best = 0.3, 0.999, None
    for _ in range(steps):
        alpha = (lo + hi) / 2
        mask = VerticalSlashPolicy(alpha=alpha, dense_tail=64, tail_samples=16, full_density=0.6).select(0, q, k, SCALE)
        d = mask.density()
        if best is None or abs(d - target) < abs(best[2] - target):
            best = (mask, alpha, d)
        lo, hi = (alpha, hi) if d < target else (lo, alpha)
    return best


def bench(fn, rep_ms: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_header(args) -> dict:
    """When, where and with what a GPU benchmark ran (its results files' common keys)."""
    import flashinfer
    import triton

    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": flashinfer.__version__,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


def two_plan_probe(mask, q, k, v, ref, backend: str, ws, rep_ms: float) -> dict:
    """Kernel times (ms) of the design FlashInfer's one-page-size-per-plan leaves for pages of a
    whole block: plan A = every (head, query block)'s blocks (diagonal last, causal) as pages of B
    tokens of one head, plan B = its columns in no selected block as pages of one token (not
    causal; requests without columns left out), merged by log-sum-exp (torch here), K/V copied
    head-major per layer (what pages of B tokens of one head need; the pool is per token). Also
    plan A's lists as pages of one token, to separate the page size from the columns.
    ``rel_vs_one_plan``: its output vs ``ref`` (the executor's). Needs L % B == 0, no prefix, no
    full heads."""
    import flashinfer
    import numpy as np

    L, H, _ = k.shape
    B, nb, nqb, G, dev = mask.block_size, mask.num_blocks, mask.num_q_blocks, q.shape[1] // H, q.device
    assert L % B == 0 and mask.prefix_len == 0 and not any(mask.full)
    kw = dict(sm_scale=SCALE, q_data_type=q.dtype, kv_data_type=k.dtype)
    head_major = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731
    t = {"kv_copy": bench(lambda: (head_major(k), head_major(v)), rep_ms)}
    kh, vh = head_major(k), head_major(v)
    q_req = q.view(L, H, G, D).transpose(0, 1).reshape(H * L, G, D)
    R = H * nqb
    qo = torch.arange(R + 1, dtype=torch.int32) * B
    indptr = mask.block_indptr.to(torch.int32)
    per_head = mask.block_indptr[::nqb].diff()
    pages = mask.block_indices + torch.repeat_interleave(torch.arange(H) * nb, per_head)
    wrap = lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)  # noqa: E731
    wa = wrap()
    wa.plan(
        qo, indptr, pages.to(dev, torch.int32), torch.full((R,), B, dtype=torch.int32), G, 1, D, B, causal=True, **kw
    )
    paged_b = (kh.view(H * nb, B, 1, D), vh.view(H * nb, B, 1, D))
    t["p64_blocks"] = bench(lambda: wa.run(q_req, paged_b, return_lse=True), rep_ms)
    o_a, s_a = wa.run(q_req, paged_b, return_lse=True)
    paged_1 = (kh.view(H * L, 1, 1, D), vh.view(H * L, 1, 1, D))
    w1 = wrap()
    keys = (pages[:, None] * B + torch.arange(B)).view(-1)
    w1.plan(qo, indptr * B, keys.to(dev, torch.int32), torch.ones(R, dtype=torch.int32), G, 1, D, 1, causal=True, **kw)
    t["p1_blocks"] = bench(lambda: w1.run(q_req, paged_1), rep_ms)
    table = mask.block_table().numpy()
    starts = np.arange(nqb) * B
    c_rows, c_pages = [], []
    for h in range(H):
        c = mask.cols(h).numpy()
        kept = (c[None, :] < starts[:, None]) & ~table[h][:, c // B]
        j, w = np.nonzero(kept)  # row-major: request by request
        c_rows.append(h * nqb + j)
        c_pages.append(h * L + c[w])
    c_rows, c_pages = np.concatenate(c_rows), np.concatenate(c_pages)
    reqs, counts = np.unique(c_rows, return_counts=True)
    if len(reqs):
        wb = wrap()
        qo_b = torch.arange(len(reqs) + 1, dtype=torch.int32) * B
        kv_b = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        wb.plan(
            qo_b,
            kv_b,
            torch.from_numpy(c_pages).to(dev, torch.int32),
            torch.ones(len(reqs), dtype=torch.int32),
            G,
            1,
            D,
            1,
            causal=False,
            **kw,
        )
        rows = (torch.from_numpy(reqs)[:, None] * B + torch.arange(B)).view(-1).to(dev)
        q_b = q_req[rows]
        t["p1_cols"] = bench(lambda: wb.run(q_b, paged_1, return_lse=True), rep_ms)
        o_b, s_b = wb.run(q_b, paged_1, return_lse=True)

        def merge(o):  # rows with columns: log2-sum-exp weights, in place
            sa = s_a[rows]
            m = torch.maximum(sa, s_b)
            wa_, wb_ = torch.exp2(sa - m), torch.exp2(s_b - m)
            o[rows] = ((o[rows] * wa_[..., None] + o_b * wb_[..., None]) / (wa_ + wb_)[..., None]).to(o.dtype)
            return o

        scratch = o_a.clone()
        t["merge"] = bench(lambda: merge(scratch), rep_ms)
        o_a = merge(o_a)
    out = o_a.view(H, L, G, D).transpose(0, 1).reshape(L, H * G, D)
    t["rel_vs_one_plan"] = rel(out, ref)
    t["two_plans"] = t["kv_copy"] + t["p64_blocks"] + t.get("p1_cols", 0) + t.get("merge", 0)
    return t


def run(args, save) -> dict:
    """Time every configuration; ``save(res)`` after each length (a killed run keeps what it has)."""
    import flashinfer
    import torch.nn.functional as F

    from sgl_loopkv.attention import build_dense_plan, dense_attention
    from sgl_loopkv.attention.sparse.flashinfer import FlashInferSparseExecutor, build_requests
    from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan
    from sgl_loopkv.kernels.block_sparse_attn import block_sparse_attention, prepare

    dev = torch.device("cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    fi_dense = {b: flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=b) for b in args.fi_backends}
    fi_sparse = {b: FlashInferSparseExecutor(backend=b) for b in args.fi_backends}
    rows, checks, probes, profiled = [], [], [], False
    for L in args.lengths:
        q32, k32 = structured_qk(L)
        v32 = torch.randn(L, HKV, D, generator=torch.Generator().manual_seed(1))
        plans = [(t, *plan_at_density(q32, k32, t)) for t in args.densities]
        base = build_dense_plan(torch.arange(L, dtype=torch.int32)[None], [0], [L], [L])
        base.kv_indices = base.kv_indices.to(dev)
        causal_cells = L * (L + 1) // 2 * HQ
        for dtype in args.dtypes:
            dt = getattr(torch, dtype)
            q, k, v = (x.to(dev, dt) for x in (q32, k32, v32))
            out = torch.empty_like(q)
            dense = {}  # dense baselines, ms
            # torch SDPA with 4-D inputs (3-D ones never reach its flash kernel): K/V expanded to the
            # query heads outside the timing, and with enable_gqa
            qh = q.transpose(0, 1)[None]
            kh, vh = (x.repeat_interleave(HQ // HKV, 1).transpose(0, 1)[None] for x in (k, v))
            sdpa = lambda qh=qh, kh=kh, vh=vh: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=SCALE)  # noqa: E731
            dense["sdpa_flash"] = bench(sdpa, args.rep_ms)
            ref = sdpa()[0].transpose(0, 1)
            kg, vg = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            try:  # may not reach the flash kernel either (then O(L^2) memory)
                dense["sdpa_gqa"] = bench(
                    lambda qh=qh, kg=kg, vg=vg: F.scaled_dot_product_attention(
                        qh, kg, vg, is_causal=True, scale=SCALE, enable_gqa=True
                    ),
                    args.rep_ms,
                )
            except torch.OutOfMemoryError:
                dense["sdpa_gqa"] = None
            torch.cuda.empty_cache()
            dense["dense_attention"] = None  # what the dense executor calls (SDPA with enable_gqa)
            if L <= args.dense_attention_max:  # on CUDA it falls back to SDPA's math kernel: O(L^2) memory
                try:
                    dense["dense_attention"] = bench(lambda q=q, k=k, v=v: dense_attention(q, k, v, SCALE), args.rep_ms)
                except torch.OutOfMemoryError:
                    pass
                torch.cuda.empty_cache()
            paged = (k.view(L, 1, HKV, D), v.view(L, 1, HKV, D))
            for b, w in fi_dense.items():
                w.plan(
                    torch.tensor([0, L], dtype=torch.int32),
                    torch.tensor([0, L], dtype=torch.int32),
                    torch.arange(L, dtype=torch.int32, device=dev),
                    torch.ones(1, dtype=torch.int32),
                    HQ,
                    HKV,
                    D,
                    1,
                    causal=True,
                    sm_scale=SCALE,
                    q_data_type=dt,
                    kv_data_type=dt,
                )
                dense[f"flashinfer_{b}"] = bench(lambda w=w, q=q, p=paged: w.run(q, p), args.rep_ms)
                checks.append({"L": L, "dtype": dtype, f"flashinfer_{b}_dense_vs_sdpa": rel(w.run(q, paged), ref)})
            all_blocks = SeqMask.all_blocks(HKV, L, L, BLOCK)
            kp_all = prepare(all_blocks, dev)
            dense["triton_all_blocks"] = bench(
                lambda q=q, k=k, v=v, m=all_blocks, p=kp_all, o=out: block_sparse_attention(
                    q, k, v, m, SCALE, plan=p, out=o
                ),
                args.rep_ms,
            )
            checks.append(
                {
                    "L": L,
                    "dtype": dtype,
                    "triton_all_blocks_vs_sdpa": rel(block_sparse_attention(q, k, v, all_blocks, SCALE), ref),
                }
            )
            best_dense = min(t for n, t in dense.items() if t is not None and n != "triton_all_blocks")
            for target, mask, alpha, density in plans:
                splan = SparsePlan(base, [mask])
                t = {}
                kp = prepare(mask, dev)
                t["triton"] = bench(
                    lambda q=q, k=k, v=v, m=mask, p=kp, o=out: block_sparse_attention(q, k, v, m, SCALE, plan=p, out=o),
                    args.rep_ms,
                )
                t["triton_prepare"] = bench(lambda m=mask: prepare(m, dev), args.rep_ms)
                t["triton_total"] = bench(
                    lambda q=q, k=k, v=v, m=mask, o=out: block_sparse_attention(q, k, v, m, SCALE, out=o), args.rep_ms
                )
                o_tr = block_sparse_attention(q, k, v, mask, SCALE)
                # the page lists alone: the Triton kernel (the executor's default on CUDA) and the torch expansion
                for kernel in (True, False):
                    t[f"fi_build_{'kernel' if kernel else 'torch'}"] = bench(
                        lambda p=splan, q=q, kn=kernel: build_requests(p, HKV, q.device, kernel=kn), args.rep_ms
                    )
                for b, ex in fi_sparse.items():
                    t[f"fi_{b}_plan"] = bench(lambda p=splan, ex=ex, q=q, k=k: ex.plan(p, q, k, SCALE), args.rep_ms)
                    reqs = ex.plan(splan, q, k, SCALE)
                    t[f"fi_{b}"] = bench(
                        lambda r=reqs, ex=ex, q=q, k=k, v=v, o=out: ex.execute(r, q, k, v, o), args.rep_ms
                    )
                    t[f"fi_{b}_total"] = bench(
                        lambda p=splan, ex=ex, q=q, k=k, v=v, o=out: ex.run(p, q, k, v, SCALE, o), args.rep_ms
                    )
                    o_fi = ex.run(splan, q, k, v, SCALE, torch.full_like(q, float("nan")))
                    checks.append({"L": L, "dtype": dtype, "density": density, f"triton_vs_fi_{b}": rel(o_tr, o_fi)})
                    if dtype in args.probe_dtypes:
                        probes.append(
                            {
                                "tokens": L,
                                "dtype": dtype,
                                "density": round(density, 4),
                                "backend": b,
                                "one_plan": t[f"fi_{b}"],
                                **two_plan_probe(mask, q, k, v, o_fi, b, ws, args.rep_ms / 3),
                            }
                        )
                        torch.cuda.empty_cache()
                    if args.profile and not profiled:
                        import cProfile
                        import pstats

                        prof = cProfile.Profile()
                        prof.runcall(lambda p=splan, ex=ex, q=q, k=k: [ex.plan(p, q, k, SCALE) for _ in range(20)])
                        torch.cuda.synchronize()
                        print(f"--- profile: 20 x FlashInferSparseExecutor.plan ({b}, L={L}, {dtype}) ---")
                        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
                        profiled = True
                cells = density * causal_cells
                sparse = {n: v for n, v in t.items() if n in ("triton", *(f"fi_{b}" for b in fi_sparse))}
                row = {
                    "tokens": L,
                    "dtype": dtype,
                    "target_density": target,
                    "density": round(density, 4),
                    "alpha": round(alpha, 4),
                    "verticals_per_head": [len(mask.cols(h)) for h in range(HKV)],
                    "full_heads": sum(mask.full),
                    "dense_ms": dense,
                    "sparse_ms": t,
                    "best_dense": next(n for n in dense if n != "triton_all_blocks" and dense[n] == best_dense),
                    "tflops": {n: 4 * D * cells / ms / 1e9 for n, ms in sparse.items()},
                    "speedup_vs_best_dense": {n: best_dense / ms for n, ms in sparse.items()},
                    "speedup_vs_sdpa_flash": {n: dense["sdpa_flash"] / ms for n, ms in sparse.items()},
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        save({"rows": rows, "checks": checks, "two_plan_probe": probes})
    return {"rows": rows, "checks": checks, "two_plan_probe": probes}


def summarize(rows: list[dict]) -> dict:
    """Per (length, target density): median over dtypes of each sparse kernel's speedup over the
    fastest dense kernel (kernel times, plans prepared) and with the per-layer planning."""
    out = {}
    for L in sorted({r["tokens"] for r in rows}):
        for t in sorted({r["target_density"] for r in rows}):
            sel = [r for r in rows if r["tokens"] == L and r["target_density"] == t]
            entry = {"density": statistics.median(r["density"] for r in sel), "best_dense": sel[0]["best_dense"]}
            for n in sel[0]["speedup_vs_best_dense"]:
                entry[f"{n}_speedup"] = round(statistics.median(r["speedup_vs_best_dense"][n] for r in sel), 3)
                total = "triton_total" if n == "triton" else f"{n}_total"
                best = [r["dense_ms"][r["best_dense"]] / r["sparse_ms"][total] for r in sel]
                entry[f"{n}_speedup_with_plan"] = round(statistics.median(best), 3)
            out[f"{L // 1024}K@{t}"] = entry
    return out


def markdown(payload: dict) -> str:
    s, rows = payload["settings"], payload["rows"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    dense_names = list(rows[0]["dense_ms"]) if rows else []
    sparse_names = [n for n in (rows[0]["speedup_vs_best_dense"] if rows else [])]
    lines = [
        f"# gpu_sparse ({payload['when']}; `python -m benchmarks.gpu_sparse`)",
        "",
        f"{payload['device']}, torch {payload['torch']}, triton {payload['triton']}, flashinfer "
        f"{payload['flashinfer']}. Attention only, one sequence of L new tokens (no cached prefix), "
        f"{HQ} q heads / {HKV} KV heads / head dim {D}, block {BLOCK}; median ms of `triton.testing.do_bench` "
        f"({s['rep_ms']} ms of calls each, L2 flushed). Plans: `loopserve` at the server defaults on structured "
        "synthetic q/k, alpha bisected to the target density (density = attended / causal cells).",
        "",
        "Dense: `sdpa_flash` = torch SDPA on 4-D inputs with K/V expanded to the 9 query heads outside the timing; `sdpa_gqa` = the same with `enable_gqa=True` (no expansion); "
        "`dense_attention` = what executor.py calls (SDPA on 3-D inputs with `enable_gqa`, which runs SDPA's math kernel; '-' = not run: O(L^2) memory); "
        "`flashinfer_<backend>` = FlashInfer paged prefill, one request; `triton_all_blocks` = the sparse "
        "kernel on the full causal plan. Sparse: `triton` = the kernel with its index tensors on the GPU, "
        "`fi_<backend>` = FlashInferSparseExecutor.execute after plan(); `+plan` = the whole per-layer call "
        "(page lists, upload, FlashInfer plan(), run). Speedup = fastest dense (not counting Triton) / sparse.",
        "",
        "| tokens | dtype | density | "
        + " | ".join(dense_names)
        + " | "
        + " | ".join(f"{n} (+plan)" for n in sparse_names)
        + " | "
        + " | ".join(f"{n} speedup (+plan)" for n in sparse_names)
        + " |",
        "|" + "---|" * (3 + len(dense_names) + 2 * len(sparse_names)),
    ]
    for r in rows:
        d, t = r["dense_ms"], r["sparse_ms"]
        total = lambda n, t=t: t["triton_total"] if n == "triton" else t[f"{n}_total"]  # noqa: E731
        best = d[r["best_dense"]]
        lines.append(
            f"| {r['tokens']} | {r['dtype']} | {r['density']:.3f} | "
            + " | ".join(fmt(d[n]) for n in dense_names)
            + " | "
            + " | ".join(f"{fmt(t[n])} ({fmt(total(n))})" for n in sparse_names)
            + " | "
            + " | ".join(f"{best / t[n]:.2f} ({best / total(n):.2f})" for n in sparse_names)
            + " |"
        )
    worst = max((v for c in payload["checks"] for n, v in c.items() if n.startswith("triton_vs_fi")), default=0)
    lines += ["", f"Consistency: max relative difference, Triton vs FlashInfer sparse outputs: {worst:.2e}."]
    builds = [r for r in rows if "fi_build_kernel" in r["sparse_ms"]]
    if builds:
        lines += [
            "",
            "FlashInfer page lists alone (`build_requests`, ms): the Triton kernel (the default on CUDA) vs "
            "the same expansion in torch ops (the CPU path); `plan` = build + FlashInfer's plan() per backend.",
            "",
            "| tokens | dtype | density | torch ops | Triton kernel | "
            + " | ".join(f"plan {b}" for b in s["fi_backends"])
            + " |",
            "|" + "---|" * (5 + len(s["fi_backends"])),
        ]
        for r in builds:
            t = r["sparse_ms"]
            lines.append(
                f"| {r['tokens']} | {r['dtype']} | {r['density']:.3f} | {fmt(t['fi_build_torch'])} | "
                f"{fmt(t['fi_build_kernel'])} | " + " | ".join(fmt(t[f"fi_{b}_plan"]) for b in s["fi_backends"]) + " |"
            )
    probes = payload.get("two_plan_probe") or []
    if probes:
        lines += [
            "",
            "Pages of a whole block (`two_plan_probe`, kernel ms): FlashInfer takes one page size per plan, so "
            "blocks as pages of 64 tokens and the columns as pages of one token are two plans (blocks causal, "
            "columns not), merged by log-sum-exp (torch), with K/V copied head-major per layer; `one plan` = "
            "the executor (page size 1, kernel only); `blocks p1` = the block lists alone at page size 1. "
            "rel. diff = two plans' output vs the executor's.",
            "",
            "| tokens | dtype | density | backend | one plan | blocks p1 | blocks p64 | columns | merge | K/V copy "
            "| two plans | two / one | rel. diff |",
            "|" + "---|" * 13,
        ]
        for r in probes:
            lines.append(
                f"| {r['tokens']} | {r['dtype']} | {r['density']:.3f} | {r['backend']} | {fmt(r['one_plan'])} | "
                f"{fmt(r['p1_blocks'])} | {fmt(r['p64_blocks'])} | {fmt(r.get('p1_cols'))} | {fmt(r.get('merge'))} | "
                f"{fmt(r['kv_copy'])} | {fmt(r['two_plans'])} | {r['two_plans'] / r['one_plan']:.2f} | "
                f"{r['rel_vs_one_plan']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--rep-ms", type=float, default=300)
    ap.add_argument("--fi-backends", nargs="+", default=["fa3", "fa2"])
    ap.add_argument("--profile", action="store_true", help="cProfile FlashInfer plan() once")
    ap.add_argument("--probe-dtypes", nargs="*", default=["float16"], help="dtypes to run two_plan_probe at")
    ap.add_argument("--dense-attention-max", type=int, default=16384, help="longest L to time dense_attention at")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sparse needs CUDA")

    def save(res: dict) -> str:
        payload = {"summary": summarize(res["rows"]), **run_header(args), **res}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_sparse.json").write_text(json.dumps(payload, indent=2) + "\n")
        (args.out / "gpu_sparse.md").write_text(markdown(payload))
        return markdown(payload)

    print(save(run(args, save)))


if __name__ == "__main__":
    main()
