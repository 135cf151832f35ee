"""Which layers share storage, per conversation (Krul Alg. 1).

Candidates are the I-R layers (``LayerStats.ir_score() >= gamma``: attention on the initial and
recent windows, so insensitive to what the next user turn says). Among them at most
``floor(num_layers * layer_ratio / 2)`` disjoint pairs (``layer_ratio`` = the share of *all* layers
that end up in a pair, as in Alg. 1's stop rule ``|S| >= N * r_l``, without its one-layer overshoot).
A pairing method maps a distance matrix, the candidates and the pair budget to the pairs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from sgl_loopkv.krul.similarity import LayerStats
from sgl_loopkv.registry import Registry

Pairs = list[tuple[int, int]]
PairingMethod = Callable[[torch.Tensor, list[int], int], Pairs]
PAIRINGS: Registry[PairingMethod] = Registry("layer pairing")

#: "optimal" never has a higher total distance than "greedy" and its agreement is no worse
#: (benchmarks/results/studies/krul_select.md).
DEFAULT_PAIRING = "optimal"


def ir_layers(stats: LayerStats, gamma: float) -> list[int]:
    """Layers whose initial+recent attention mass reaches ``gamma`` (Krul's I-R layers)."""
    if stats.ir_rows <= 0:
        return []
    return [i for i, s in enumerate(stats.ir_score().tolist()) if s >= gamma]


def max_pairs(num_layers: int, layer_ratio: float) -> int:
    return int(num_layers * layer_ratio + 1e-9) // 2


def select_pairs(stats: LayerStats, gamma: float, layer_ratio: float, method: str = DEFAULT_PAIRING) -> Pairs:
    """Disjoint (shallow, deep) pairs, shallow < deep, both I-R, at most max_pairs(L, r_l), in
    ascending distance order. The deep layer of a pair is the one stored through its shallow one."""
    cand = ir_layers(stats, gamma)
    budget = min(max_pairs(stats.num_layers, layer_ratio), len(cand) // 2)
    if budget == 0:
        return []
    dist = stats.distance()
    pairs = PAIRINGS.create(method, dist, cand, budget)
    return sorted(((min(a, b), max(a, b)) for a, b in pairs), key=lambda p: (float(dist[p]), p))


def _edges(dist: torch.Tensor, cand: list[int]) -> list[tuple[float, int, int]]:
    return [(float(dist[i, j]), i, j) for i, j in itertools.combinations(sorted(cand), 2)]


@PAIRINGS.register("greedy")
def greedy_pairs(dist: torch.Tensor, cand: list[int], budget: int) -> Pairs:
    """Alg. 1 lines 18-30: closest remaining pair first (ties: lower layers first)."""
    used: set[int] = set()
    out: Pairs = []
    for _, i, j in sorted(_edges(dist, cand)):
        if len(out) >= budget:
            break
        if i not in used and j not in used:
            used |= {i, j}
            out.append((i, j))
    return out


@PAIRINGS.register("optimal")
def optimal_pairs(dist: torch.Tensor, cand: list[int], budget: int) -> Pairs:
    """Minimum total distance over all sets of exactly ``budget`` disjoint pairs.

    Reduction to a maximum-weight *perfect* matching (Edmonds' blossom, networkx, a torch
    dependency): ``len(cand) - 2 * budget`` dummy vertices joined to every candidate absorb the
    unpaired layers; with the matching size fixed, maximising ``sum(BIG - d)`` minimises ``sum(d)``.
    Distances are scaled to integers so the blossom runs in exact arithmetic (ties within 1e-9 of
    the largest distance are broken arbitrarily).
    """
    import networkx as nx

    cand = sorted(cand)
    edges = _edges(dist, cand)
    top = max((d for d, _, _ in edges), default=0.0) or 1.0
    big = 2 * 10**9
    g = nx.Graph()
    for d, i, j in edges:
        g.add_edge(i, j, weight=big - round(d / top * 10**9))
    for m in range(len(cand) - 2 * budget):
        for i in cand:
            g.add_edge(("dummy", m), i, weight=big)
    matching = nx.max_weight_matching(g, maxcardinality=True)
    pairs = [(a, b) for a, b in matching if not isinstance(a, tuple) and not isinstance(b, tuple)]
    assert len(pairs) == budget, (len(pairs), budget)
    return [(min(a, b), max(a, b)) for a, b in pairs]


def brute_force_pairs(dist: torch.Tensor, cand: list[int], budget: int) -> Pairs:
    """Exhaustive minimum (for tests on small candidate sets)."""
    best: tuple[float, Pairs] = (float("inf"), [])

    def rec(free: list[int], chosen: Pairs, total: float):
        nonlocal best
        if len(chosen) == budget:
            best = min(best, (total, list(chosen)))
            return
        if len(free) < 2 * (budget - len(chosen)):
            return
        first, rest = free[0], free[1:]
        for j in rest:  # pair ``first`` with someone ...
            rec([x for x in rest if x != j], [*chosen, (first, j)], total + float(dist[first, j]))
        rec(rest, chosen, total)  # ... or leave it unpaired

    rec(sorted(cand), [], 0.0)
    return best[1]


def total_distance(dist: torch.Tensor, pairs: Pairs) -> float:
    return sum(float(dist[i, j]) for i, j in pairs)
