"""Which conversations should the host tier keep? attention-guided value vs LRU, on a skewed
multi-conversation workload, driving the real TieredKVStore (host tier only; tensors are small
stand-ins of the right byte sizes; only eviction decisions are measured).

Workload (deterministic by seed): N conversations with Zipf(s) popularity and lengths 1K-8K
tokens; each visit is a new turn that re-reads the whole history. A conversation's attention
profile is fixed: a sink chunk, its recent chunks and a few "evidence" chunks carry most of the
mass (what real attention looks like; the value policy sees the per-chunk mass the way the
server's probe layer reports it). Metric: host hit ratio in tokens (history served from the host
tier instead of disk/recompute), for host quotas of 10-40% of the total history bytes.

    python -m benchmarks.studies.cache_policy
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.studies import write_results
from sgl_loopkv.cache.layout import KVGeometry
from sgl_loopkv.cache.segment_record import SegmentRecord
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES

GEO = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, chunk_tokens=16)


def workload(n_conv: int, n_visits: int, zipf_s: float, seed: int):
    rng = random.Random(seed)
    lengths = [rng.randrange(64, 512) * 16 for _ in range(n_conv)]  # 1K..8K tokens
    weights = [1 / (i + 1) ** zipf_s for i in range(n_conv)]
    order = list(range(n_conv))
    rng.shuffle(order)  # popularity independent of length
    visits = rng.choices(order, weights=weights, k=n_visits)
    profiles = []
    for L in lengths:
        m = L // 16
        mass = torch.full((m,), 0.02)
        mass[0] += 1.0  # sink
        mass[-4:] += 0.5  # recent turns
        for j in rng.sample(range(m), k=min(3, m)):
            mass[j] += 1.0  # evidence
        profiles.append(mass * (m / mass.sum()))  # normalised as the server does: mean 1 per chunk
    return lengths, visits, profiles


def simulate(policy: str, quota: int, lengths, visits, profiles) -> float:
    store = TieredKVStore(GEO, VALUE_POLICIES.create(policy), host_quota_bytes=quota)
    hit = total = 0
    for c in visits:
        sid, L = f"c{c}", lengths[c]
        total += L
        if store.tier_of(sid) == "host":
            hit += L
            store.touch(sid, L // 16, profiles[c])
        else:  # recomputed (or read from disk) and written through to the host tier again
            kv = torch.zeros(GEO.num_layers, 2, L, GEO.num_kv_heads, GEO.head_dim)
            summ = torch.zeros(GEO.num_layers, L // 16, GEO.num_kv_heads, 2, GEO.head_dim)
            store.drop(sid)
            store.put(SegmentRecord(sid, None, 0, L // 16, 0), kv, summ)
            store.touch(sid, L // 16, profiles[c])
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--visits", type=int, default=4000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    fractions = [0.1, 0.2, 0.3, 0.4]
    rows, results = [], {}
    for frac in fractions:
        ratios = {"attention": [], "lru": []}
        for seed in range(args.seeds):
            lengths, visits, profiles = workload(args.conversations, args.visits, args.zipf, seed)
            quota = int(frac * sum(GEO.segment_host_bytes(L // 16) for L in lengths))
            for policy in ratios:
                ratios[policy].append(simulate(policy, quota, lengths, visits, profiles))
        att, lru = sum(ratios["attention"]) / args.seeds, sum(ratios["lru"]) / args.seeds
        results[frac] = {"attention_hit_ratio": att, "lru_hit_ratio": lru, "per_seed": ratios}
        rows.append([f"{frac:.0%}", att, lru, att / lru])
    summary = {
        "hit_ratio_attention_20pct": results[0.2]["attention_hit_ratio"],
        "hit_ratio_lru_20pct": results[0.2]["lru_hit_ratio"],
        "attention_over_lru_20pct": results[0.2]["attention_hit_ratio"] / results[0.2]["lru_hit_ratio"],
    }
    payload = {"summary": summary, "results": results, "args": vars(args), "env": environment()}
    md = (
        f"# cache_policy ({payload['env']['when']}; {args.conversations} conversations, {args.visits} turns, "
        f"Zipf {args.zipf}, mean of {args.seeds} seeds)\n\nHost-tier hit ratio (tokens):\n\n"
        + md_table(["host quota (of all history bytes)", "attention-guided", "LRU", "attention / LRU"], rows)
    )
    write_results("cache_policy", payload, md)
    print(md)


if __name__ == "__main__":
    main()
