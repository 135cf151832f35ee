"""Restoration plans: for each layer, how many front tokens of a returning history to recompute and
how many to load (Krul section 6), chosen from a cost model by a planner.

Why the front: under causal attention, recomputing tokens [0, s) of layer l needs only the K/V of
[0, s) at layer l, which are being recomputed too, so recomputation never waits for a load. Why
non-increasing in depth: layer l + 1 recomputes from the hidden states layer l produced, which
exist only for the tokens layer l recomputed (Krul Eq. 4-5).

The timeline model (:func:`simulate`) has two streams that start together once the disk part has
been read (the tiered store verifies disk extents before a match is promised):

- compute: recompute layer 0 .. N-1 (front tokens), then the new turn's extend layer by layer,
  each extend layer waiting until that layer's load is done;
- load: copy layer 0 .. N-1's loaded tokens into the KV pool.

Where the loads do not run beside the compute (``RestoreJob.overlapped`` False: a CPU pool, whose
loads run before the forward, :mod:`sgl_loopkv.cache.loader`), the compute stream starts once every
layer is loaded.

A bubble is time the compute stream waits for the load stream. The best plan minimises the time
until the new turn's extend finishes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from sgl_loopkv.registry import Registry
from sgl_loopkv.restore.config import RestoreConfig


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """``recompute[l]`` front tokens of layer ``l`` are recomputed, the other ``total - recompute[l]``
    loaded. Always non-increasing in depth and chunk-aligned (or == total)."""

    total: int
    recompute: tuple[int, ...]

    def __post_init__(self):
        r = self.recompute
        if any(not 0 <= s <= self.total for s in r):
            raise ValueError(f"recompute counts must lie in [0, {self.total}]: {r}")
        if any(b > a for a, b in zip(r, r[1:])):
            raise ValueError(f"recompute counts must be non-increasing with depth: {r}")

    @property
    def num_layers(self) -> int:
        return len(self.recompute)

    def load(self, layer: int) -> int:
        return self.total - self.recompute[layer]

    @property
    def recompute_tokens(self) -> int:
        return self.recompute[0] if self.recompute else 0

    @property
    def recompute_fraction(self) -> float:
        """Share of the history's token-layers recomputed (0 = load all, 1 = recompute all)."""
        return sum(self.recompute) / max(1, self.total * self.num_layers)

    @classmethod
    def load_all(cls, total: int, num_layers: int) -> RestorePlan:
        return cls(total, (0,) * num_layers)

    @classmethod
    def recompute_all(cls, total: int, num_layers: int) -> RestorePlan:
        return cls(total, (total,) * num_layers)


@dataclass(slots=True)
class CostModel:
    """Seconds per unit of work on this machine (calibrated at start-up, refined online).

    Recomputing (or extending) ``s > 0`` rows of one layer after ``p`` cached positions costs
    ``layer_s + token_s * s + attn_s * s * (p + s / 2)`` (a fixed cost per layer call, projections
    and MLP, causal attention pairs; without ``layer_s`` a planner buys a few ms of simulated overlap
    with a small front recompute that costs more in call overheads on a CPU);
    copying one layer of ``t`` tokens into the pool costs ``t * layer_bytes / copy_bps``; reading
    it from disk ``t * stored_layer_bytes / disk_bps``.
    """

    token_s: float = 2e-5
    attn_s: float = 2e-9
    layer_s: float = 0.0
    copy_bps: float = 4e9
    disk_bps: float = 1e9
    source: str = "default"

    def rows_s(self, s: int, p: int) -> float:
        return self.layer_s + self.token_s * s + self.attn_s * s * (p + s / 2) if s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RestoreJob:
    """What is being restored: ``total`` stored tokens after ``prefix`` tokens already on the
    device, ``disk_tokens`` of them still on disk; then ``new_tokens`` of the new turn."""

    total: int
    num_layers: int
    layer_bytes: int  # pool bytes of one token of one layer (K and V)
    prefix: int = 0
    new_tokens: int = 1
    disk_tokens: int = 0
    stored_layer_bytes: float | None = None  # mean stored bytes per token-layer (compressed), default layer_bytes
    chunk: int = 16
    overlapped: bool = True  # loads run beside the compute (a loader thread); False: all of them first


@dataclass(slots=True)
class Timeline:
    finish_s: float  # the new turn's extend done
    restored_s: float  # every layer restored (both streams done)
    compute_s: float  # recompute stream busy time
    load_s: float  # load stream busy time (disk read included)
    bubble_s: float  # compute stream waiting for loads
    per_layer: list[tuple[float, float]] = field(default_factory=list)  # (recompute done, load done)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.finish_s if self.finish_s > 0 else 0.0


def simulate(plan: RestorePlan, job: RestoreJob, cost: CostModel) -> Timeline:
    stored = job.stored_layer_bytes or job.layer_bytes
    disk_frac = job.disk_tokens / job.total if job.total else 0.0
    # Disk part first (verified whole before the match is promised); only loaded tokens are read.
    disk = sum(plan.load(layer) * disk_frac for layer in range(plan.num_layers)) * stored / cost.disk_bps
    t_c = t_l = disk
    if not job.overlapped:  # every layer loaded before the compute starts
        t_c += sum(plan.load(layer) for layer in range(plan.num_layers)) * job.layer_bytes / cost.copy_bps
    start = t_c
    per_layer = []
    for layer in range(plan.num_layers):
        t_c += cost.rows_s(plan.recompute[layer], job.prefix)
        t_l += plan.load(layer) * job.layer_bytes / cost.copy_bps
        per_layer.append((t_c, t_l))
    compute_busy, load_busy = t_c - start, t_l
    restored = max(t_c, t_l)
    bubble = 0.0
    for _, load_done in per_layer:  # the extend, layer by layer, waits for each layer's load
        if load_done > t_c:
            bubble += load_done - t_c
            t_c = load_done
        t_c += cost.rows_s(job.new_tokens, job.prefix + job.total)
    return Timeline(t_c, restored, compute_busy, load_busy, bubble, per_layer)


class RestorePlanner(ABC):
    """Chooses a :class:`RestorePlan` for a job under a cost model. Every plan it returns is valid
    (non-increasing, chunk-aligned or == total).

    ``needs_cost_model``: the plan depends on the cost model, so the restorer calibrates it on the
    running machine before the first restore (a planner that ignores it saves that time)."""

    needs_cost_model: ClassVar[bool] = False

    @abstractmethod
    def plan(self, job: RestoreJob, cost: CostModel) -> RestorePlan: ...


#: name -> factory(config: RestoreConfig | None) -> RestorePlanner (each planner reads its own fields)
PLANNERS: Registry[RestorePlanner] = Registry("restore planner")


class LoadAll(RestorePlanner):
    def plan(self, job, cost):
        return RestorePlan.load_all(job.total, job.num_layers)


class RecomputeAll(RestorePlanner):
    def plan(self, job, cost):
        return RestorePlan.recompute_all(job.total, job.num_layers)


def _chunk_floor(s: float, job: RestoreJob) -> int:
    s = min(max(s, 0.0), job.total)
    return job.total if s >= job.total else int(s) // job.chunk * job.chunk


class FixedSplit(RestorePlanner):
    """The same front share in every layer (Pensieve/Cake-style partial recompute)."""

    def __init__(self, ratio: float = 0.4):
        self.ratio = ratio

    def plan(self, job, cost):
        return RestorePlan(job.total, (_chunk_floor(self.ratio * job.total, job),) * job.num_layers)


def pyramid(job: RestoreJob, top: float, slope: float) -> RestorePlan:
    """``top`` tokens recomputed at layer 0, ``slope`` fewer per layer (Krul's pyramid)."""
    return RestorePlan(job.total, tuple(_chunk_floor(top - slope * layer, job) for layer in range(job.num_layers)))


class KrulPlanner(RestorePlanner):
    """Searches pyramids (top x slope) and keeps the one with the earliest simulated finish; load-all
    and recompute-all are candidates too, so it is never worse than either under its cost model.

    The candidates are simulated together (:func:`finish_times`, one array per stream): a planner
    on the resume's critical path must cost far less than the time it saves, and a Python loop over
    its ~600 candidates cost tens of milliseconds."""

    needs_cost_model = True

    def __init__(self, tops: int = 96, slopes: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)):
        self.tops, self.slopes = tops, slopes

    def candidates(self, job: RestoreJob) -> np.ndarray:
        """[C, L] recompute tokens per candidate and layer; row 0 is load-all."""
        n = job.num_layers
        step = max(job.chunk, -(-job.total // self.tops) // job.chunk * job.chunk)
        tops = np.array(sorted({*range(job.chunk, job.total + 1, step), job.total}), dtype=np.float64)
        slopes = np.array(self.slopes, dtype=np.float64)
        top = np.repeat(tops, len(slopes))[:, None]
        s = top - (np.tile(slopes, len(tops))[:, None] * top / n) * np.arange(n)[None, :]
        s = np.clip(s, 0.0, job.total)
        rows = np.where(s >= job.total, job.total, np.floor(s).astype(np.int64) // job.chunk * job.chunk)
        return np.concatenate([np.zeros((1, n), dtype=np.int64), rows.astype(np.int64)])

    def plan(self, job, cost):
        if load_all_is_optimal(job, cost):  # most CPU resumes: no candidate to simulate
            return RestorePlan.load_all(job.total, job.num_layers)
        cands = self.candidates(job)
        t = finish_times(cands, job, cost)
        best = int(np.argmin(t))
        if t[0] <= t[best] + 1e-12:  # a tie keeps load-all (no compute spent for nothing)
            best = 0
        return RestorePlan(job.total, tuple(int(x) for x in cands[best]))


def load_all_is_optimal(job: RestoreJob, cost: CostModel) -> bool:
    """Whether load-all finishes first among every split, decided without simulating any, when the
    loads run before the forward (``not job.overlapped``: a CPU pool). Then a split's finish is its
    load time plus its recompute time plus the extend, so moving a token-layer from load to recompute
    costs its recompute and saves its load. A layer's recompute of ``s`` front tokens
    (:meth:`CostModel.rows_s`) is convex in ``s``, its marginal cost never below
    ``token_s + attn_s * prefix``: if that already exceeds one token-layer's load (copy, plus the disk
    read of the disk-only share), no split beats load-all (the simulated search would keep load-all
    too, at a tie or better)."""
    if job.overlapped or job.total == 0:
        return False
    stored = job.stored_layer_bytes or job.layer_bytes
    load_s = job.layer_bytes / cost.copy_bps + (job.disk_tokens / job.total) * stored / cost.disk_bps
    return cost.token_s + cost.attn_s * job.prefix >= load_s


def finish_times(recompute: np.ndarray, job: RestoreJob, cost: CostModel) -> np.ndarray:
    """:func:`simulate`'s ``finish_s`` for each row of ``recompute`` ([C, L] front tokens per layer)."""
    r = recompute.astype(np.float64)
    load = job.total - r
    stored = job.stored_layer_bytes or job.layer_bytes
    disk_frac = job.disk_tokens / job.total if job.total else 0.0
    disk = load.sum(1) * disk_frac * stored / cost.disk_bps
    rows = np.where(
        r > 0, cost.layer_s + cost.token_s * r + cost.attn_s * r * (job.prefix + r / 2), 0.0
    )  # CostModel.rows_s per layer
    t_l = disk[:, None] + np.cumsum(load * job.layer_bytes / cost.copy_bps, axis=1)
    t_c = (disk if job.overlapped else t_l[:, -1]) + rows.sum(1)
    ext = cost.rows_s(job.new_tokens, job.prefix + job.total)
    for layer in range(r.shape[1]):  # the extend waits for each layer's load
        t_c = np.maximum(t_c, t_l[:, layer]) + ext
    return t_c


@PLANNERS.register("load_all")
def _load_all(config: RestoreConfig | None = None) -> RestorePlanner:
    return LoadAll()


@PLANNERS.register("recompute_all")
def _recompute_all(config: RestoreConfig | None = None) -> RestorePlanner:
    return RecomputeAll()


@PLANNERS.register("fixed")
def _fixed(config: RestoreConfig | None = None) -> RestorePlanner:
    return FixedSplit((config or RestoreConfig()).ratio)


@PLANNERS.register("krul")
def _krul(config: RestoreConfig | None = None) -> RestorePlanner:
    return KrulPlanner()
