"""Decode attention paths, in process (no server): what one layer's decode attention costs on each
path of the ``torch`` executor, by context, batch size and slot layout, next to the cost of only
gathering the batch's KV (the issue 13 bar: a decode step's attention should cost about a gather,
whatever the layout). The rule in :meth:`TorchDenseExecutor.decode_path` is read off this table.

Layouts: each sequence's context is split into ``runs`` contiguous slot runs placed at random,
non-overlapping, page-aligned positions of one pool (1 = a fresh contiguous history; L/16 = every
16-token page elsewhere, a resumed history in a fragmented pool). Paths: ``native`` (the C++
kernel, whole batch in one call), ``views`` (per sequence, two matmuls per run; only up to
``MAX_RUNS`` runs, beyond that the executor gathers), ``gather`` (per sequence, index the KV, then
two matmuls); ``gather only`` = ``k[idx], v[idx]`` for every sequence, no attention. Timings: median
of ``--repeats`` calls after warm-up, SmolLM2's head shape (9 query heads, 3 KV heads, D 64).

    python -m benchmarks.studies.decode_paths            # ~15 s on 2 cores
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from tqdm import tqdm

from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.harness.stats import median_call_s
from benchmarks.studies import write_results
from sgl_loopkv.attention.executor import DecodePath, TorchDenseExecutor
from sgl_loopkv.attention.plan import MAX_RUNS, AttentionPlan

HQ, HKV, D, PAGE = 9, 3, 64, 16  # SmolLM2-135M's attention shape


def layout(bs: int, L: int, runs: int, seed: int) -> tuple[torch.Tensor, list[int], int]:
    """Slots of ``bs`` sequences of ``L`` tokens (a multiple of 16), each in ``runs`` equal runs of
    consecutive pages; the pool is cut into blocks of one run's size, twice as many as needed, and
    every sequence gets random free blocks in random order: (kv_indices, kv_indptr, pool size)."""
    g = torch.Generator().manual_seed(seed)
    run_len = L // runs
    blocks = torch.randperm(2 * bs * runs, generator=g)[: bs * runs].view(bs, runs)
    seqs = [torch.cat([torch.arange(int(blk) * run_len, (int(blk) + 1) * run_len) for blk in row]) for row in blocks]
    indptr = [0]
    for s in seqs:
        indptr.append(indptr[-1] + len(s))
    return torch.cat(seqs), indptr, 2 * bs * runs * run_len


def gather_all(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, indptr: list[int]) -> list:
    """What the bar is: only indexing every sequence's K and V out of the pool."""
    return [(k[idx[a:b]], v[idx[a:b]]) for a, b in zip(indptr, indptr[1:])]


def measure(contexts, batch_sizes, repeats) -> list[dict]:
    ex = TorchDenseExecutor()
    rows = []
    cases = [(L, bs, runs) for L in contexts for bs in batch_sizes for runs in sorted({1, 8, L // PAGE})]
    for L, bs, runs in tqdm(cases, desc="decode paths"):
        idx, indptr, pool = layout(bs, L, runs, seed=L + bs + runs)
        k, v = torch.randn(pool, HKV, D), torch.randn(pool, HKV, D)
        q = torch.randn(bs, HQ, D)
        plan = AttentionPlan(list(range(bs + 1)), indptr, idx, causal=True)
        got_runs = max(len(plan.runs(i) or [None] * (MAX_RUNS + 1)) for i in range(bs))
        row = {"context": L, "bs": bs, "runs": runs, "runs_seen": got_runs}
        ref = None
        for path in ("native", "views", "gather"):
            if path == "native" and ex.native is None:
                continue
            if path == "views" and any(plan.runs(i) is None for i in range(bs)):
                row[path] = None  # the executor never takes views past MAX_RUNS runs
                continue
            ex.decode_path = lambda plan, k_cache, p=path: DecodePath(p)  # forced, for the table
            out = torch.empty(bs, HQ, D)
            row[path] = median_call_s(partial(ex.run_decode, plan, q, k, v, D**-0.5, out), repeats)
            ref = out.clone() if ref is None else ref
            torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)  # every path computes the same thing
        row["gather only"] = median_call_s(partial(gather_all, k, v, idx, indptr), repeats)
        del ex.decode_path
        row["rule"] = str(ex.decode_path(plan, k))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rows = measure(args.contexts, args.batch_sizes, args.repeats)
    us = lambda x: "-" if x is None else f"{1e6 * x:.0f}"  # noqa: E731
    paths = [p for p in ("native", "views", "gather") if any(r.get(p) for r in rows)]
    table = [
        [r["context"], r["bs"], r["runs"], *(us(r.get(p)) for p in paths), us(r["gather only"]),
         f"{min(r[p] for p in paths if r.get(p)) / r['gather only']:.2f}", r["rule"]]
        for r in rows
    ]  # fmt: skip
    env = environment()
    md = (
        f"# decode_paths ({env['when']}; `python -m benchmarks.studies.decode_paths`; {torch.get_num_threads()} threads, "
        f"median of {args.repeats} calls)\n\n"
        "One layer's decode attention, microseconds, fp32, 9 query / 3 KV heads, D 64; runs = slot runs per sequence "
        "(context/16 = every page scattered); best / gather = the fastest path over gathering the KV alone; rule = "
        "the path the executor picks on this machine.\n\n"
        + md_table(
            ["context", "bs", "runs", *(f"{p} us" for p in paths), "gather only us", "best / gather", "rule"], table
        )
    )
    write_results("decode_paths", {"env": env, "config": vars(args), "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
