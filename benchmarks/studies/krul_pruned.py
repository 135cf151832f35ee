"""Would the Krul planner's front recompute help a chunk-pruned restore? A model computation, not a
server run: the restore planner (``sgl_loopkv/restore/plan.py``: ``KrulPlanner``, ``simulate``) under
the cost model a server calibrates at start-up (its log line "loopkv restore cost model calibrated";
the defaults are the 2026-11-26 10:58 one), for a pruned restore streamed from the host tier or from a
cold disk.

How a pruned restore is put to the planner: every layer loads ``budget`` of its history (the kept
chunks: the first, the nearest and the best scored, spread over the history), so a history token of
one layer costs ``budget`` x its bytes to load, at the host copy rate or at the cold-disk rate (the
streamed reads overlap the forward, so the disk rate stands in for the copy rate and nothing is read
before the extend). A front recompute of ``r`` tokens at a layer saves loading the kept chunks among
them and costs the layer's call, projections and attention for ``r`` rows.

    python -m benchmarks.studies.krul_pruned [--layer-s 1.46e-3 --token-s 2.52e-5 --attn-s 2.59e-8 --copy-gbps 12.6
                                      --disk-gbps 0.48]
"""

from __future__ import annotations

import argparse

from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.studies import write_results
from sgl_loopkv.restore.plan import CostModel, KrulPlanner, RestoreJob, RestorePlan, simulate

SMOLLM2 = dict(num_layers=30, layer_bytes=2 * 3 * 64 * 4)  # fp32 K and V of one token of one layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer-s", type=float, default=1.46e-3)
    ap.add_argument("--token-s", type=float, default=2.52e-5)
    ap.add_argument("--attn-s", type=float, default=2.59e-8)
    ap.add_argument("--copy-gbps", type=float, default=12.6)
    # 19 MB of selected extents read cold in 39-44 ms (the lab notes of 2026-11-25, docs/decisions/index.md)
    ap.add_argument("--disk-gbps", type=float, default=0.48)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    rows, table = [], []
    for source, gbps in (("host", args.copy_gbps), ("disk", args.disk_gbps)):
        cost = CostModel(args.token_s, args.attn_s, args.layer_s, gbps * 1e9, gbps * 1e9, "cli")
        for tokens in (2048, 4096, 8192):
            for budget in (0.05, 0.1, 0.25, 0.5, 1.0):
                job = RestoreJob(
                    total=tokens, num_layers=SMOLLM2["num_layers"], layer_bytes=round(SMOLLM2["layer_bytes"] * budget),
                    new_tokens=args.new_tokens,
                )  # fmt: skip
                plan = KrulPlanner().plan(job, cost)
                load_all = simulate(RestorePlan.load_all(tokens, job.num_layers), job, cost)
                best = simulate(plan, job, cost)
                row = dict(
                    source=source, tokens=tokens, budget=budget, recompute_layer0=plan.recompute[0],
                    recompute_token_layers=plan.recompute_tokens, load_only_ms=load_all.finish_s * 1e3,
                    load_only_bubble_ms=load_all.bubble_s * 1e3, planned_ms=best.finish_s * 1e3,
                    gain=load_all.finish_s / best.finish_s,
                )  # fmt: skip
                rows.append(row)
                table.append([source, tokens, budget, row["recompute_layer0"], round(row["load_only_ms"], 1),
                              round(row["load_only_bubble_ms"], 1), round(row["planned_ms"], 1), round(row["gain"], 3)])  # fmt: skip
    md = (
        "# Krul's front recompute for a chunk-pruned restore (model computation, SmolLM2 fp32)\n\n"
        f"`python -m benchmarks.studies.krul_pruned`; cost model: {args.layer_s:.3g} s/layer + {args.token_s:.3g} s/token-layer"
        f" + {args.attn_s:.3g} s/attention pair, host copy {args.copy_gbps} GB/s, cold disk {args.disk_gbps} GB/s;"
        f" {args.new_tokens} new tokens. Times are the planner's simulated extend finish, not measurements.\n\n"
        + md_table(
            [
                "source",
                "history",
                "budget",
                "recompute at layer 0",
                "load only ms",
                "its bubbles ms",
                "planned ms",
                "gain x",
            ],
            table,
        )  # fmt: skip
    )
    summary = {
        "max_gain": max(r["gain"] for r in rows),
        "recompute_at_budget_0.1": sum(r["recompute_token_layers"] for r in rows if r["budget"] == 0.1),
    }
    write_results("krul_pruned", {"env": environment(), "args": vars(args), "summary": summary, "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
