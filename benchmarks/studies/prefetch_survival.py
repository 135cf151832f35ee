"""How much of a period's chunk set does the next period keep? The evidence behind
``--loopkv-prefix-prefetch`` (issue 15): ContiguousKV reads a period's whole set ahead for the next
period; whatever that period then drops was read for nothing.

In process (HF transformers, SmolLM2 fp32): the benchmark's synthetic history, then four turns (the
re-prefill benchmark's turns A, B and two TTFT turns); at each period's first layer the chunks are
selected exactly as the server does (``selection.chunks`` over the key min/max summaries). For a
read-ahead share F of each set (the always-kept first and nearest chunks, then the best scored),
over all periods: read amplification = 1 + (chunks read ahead and dropped) / (chunks used), and
coverage = (chunks read ahead and kept) / (chunks used), i.e. the share of the reads that happened
before the period's own selection. Medians over the turns.

    python -m benchmarks.studies.prefetch_survival            # 4K history (about 1 min)
    python -m benchmarks.studies.prefetch_survival --length 8000

Writes benchmarks/results/prefetch_survival.{json,md}.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import synthetic_ids
from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.stats import median
from benchmarks.reprefill import CHUNK, HIST_SEED, PREFIX, Capture, turn_a, turn_b, turn_ttft
from benchmarks.studies import write_results
from sgl_loopkv.cache.layout import key_summaries
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import ensure_default_model
from sgl_loopkv.selection.chunks import always_kept, chunk_scores, keep_count, select_chunks

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
BUDGETS = (0.05, 0.1, 0.25, 0.5)


def survival(q: dict, summ: torch.Tensor, scale: float, layers: int, m: int, budget: float) -> dict:
    """Per read-ahead share: read amplification and coverage over every period boundary of one turn."""
    keep, period, local = keep_count(m, budget), PREFIX.period, PREFIX.local
    ahead, wasted, used = dict.fromkeys(SHARES, 0), dict.fromkeys(SHARES, 0), 0
    sets = []
    for p0 in range(0, layers, period):
        scores = chunk_scores(q[p0], summ[p0], scale, CHUNK)
        sets.append((scores, select_chunks(scores, keep, local), min(p0 + period, layers) - p0))
    forced = always_kept(m, keep, local)
    for i, (scores, chunks, n_layers) in enumerate(sets):
        used += len(chunks) * n_layers
        if i + 1 == len(sets):
            continue
        nxt, nl = set(sets[i + 1][1].tolist()), sets[i + 1][2]
        order = chunks[torch.argsort(scores[chunks].masked_fill(forced[chunks], torch.inf), descending=True)]
        for f in SHARES:
            read = order[: max(int(forced[chunks].sum()), round(f * len(chunks)))].tolist()
            ahead[f] += len(read) * nl
            wasted[f] += sum(c not in nxt for c in read) * nl
    return {
        str(f): {"read_amplification": 1 + wasted[f] / used, "coverage": (ahead[f] - wasted[f]) / used} for f in SHARES
    }


@torch.inference_mode()
def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    args = ap.parse_args()
    load_start = os.getloadavg()
    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cap = Capture()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="loopkv_reprefill")
    layers, L = model.config.num_hidden_layers, args.length
    hist, cache = synthetic_ids(tok, L, seed=HIST_SEED), DynamicCache()
    for s in range(0, L, 2048):
        model(input_ids=torch.tensor([hist[s : s + 2048]]), past_key_values=cache, use_cache=True)
    turns = {"a": turn_a(tok), "b": turn_b(tok), "ttft0": turn_ttft(tok, 0), "ttft1": turn_ttft(tok, 1)}
    per_turn = {}
    for name, turn in turns.items():
        cache.crop(L)
        cap.on = True
        model(input_ids=torch.tensor([turn]), past_key_values=cache, use_cache=True)
        cap.on = False
        summ = key_summaries(torch.stack([cap.k[x][:L] for x in range(layers)]), CHUNK)
        per_turn[name] = {str(b): survival(cap.q, summ, cap.scale, layers, L // CHUNK, b) for b in BUDGETS}
    table = {
        str(b): {
            str(f): {
                k: median([per_turn[t][str(b)][str(f)][k] for t in turns]) for k in ("read_amplification", "coverage")
            }
            for f in SHARES
        }
        for b in BUDGETS
    }
    payload = {
        "config": {"command": "python -m benchmarks.studies.prefetch_survival --length " + str(L), "length": L,
                   "period": PREFIX.period, "local": PREFIX.local, "shares": SHARES, "budgets": BUDGETS},
        "per_turn": per_turn,
        "median": table,
        "env": environment() | {"loadavg_start": load_start, "loadavg_end": os.getloadavg()},
    }  # fmt: skip
    lines = [
        f"# inter-period prefetch: survival of the chunks read ahead ({payload['env']['when']}; "
        f"`{payload['config']['command']}`; {machine_label()})",
        "",
        f"SmolLM2-135M-Instruct fp32 in process, a {L}-token history, period {PREFIX.period}, {PREFIX.local} local chunks; "
        "medians over 4 turns. Per budget and read-ahead share F (the always-kept chunks first, then the best scored): "
        "read amplification (1 + wasted / used) / coverage (share of the used reads done ahead).",
        "",
        "| budget | " + " | ".join(f"F = {f:g}" for f in SHARES) + " |",
        "|---|" + "---|" * len(SHARES),
    ]
    for b in BUDGETS:
        cells = [
            f"{table[str(b)][str(f)]['read_amplification']:.3f} / {table[str(b)][str(f)]['coverage']:.2f}"
            for f in SHARES
        ]
        lines.append(f"| {b:g} | " + " | ".join(cells) + " |")
    write_results("prefetch_survival", payload, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
