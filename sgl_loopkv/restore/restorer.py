"""The restoration scheduler of the tiered cache: plan a returning history's split, run the front
recompute while the loader thread copies the rest, learn the machine's costs as it goes.

The cost model is calibrated once on the running machine (the first time it is needed: the
model's layers are timed on dummy tokens, and a pool-sized copy is timed) and refined online from
every restore (exponential moving average of measured / predicted per stream).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sgl_loopkv.restore.plan import PLANNERS, CostModel, RestoreJob, RestorePlan, RestorePlanner, simulate
from sgl_loopkv.restore.recompute import LayerStack, recompute_front

logger = logging.getLogger(__name__)

EMA = 0.3  # weight of a new measurement in the online refinement


#: Where a resume's time goes (``loopkv_restore_seconds{part}``, wall seconds). ``held``: a request
#: whose history only the disk held sat out scheduler rounds while it was read on the read-ahead
#: thread (the read's own parts are the store's). On the scheduler thread, in order: ``lookup`` (tree walk, cross-worker discovery), ``plan`` (the planner itself),
#: ``fetch`` (taking the stored bytes from their tier: a host slice, or a disk read with its
#: verification and promotion), ``alloc`` (pool slots, evictions for them), ``recompute`` (the
#: plan's front). On the loader thread, beside the forward: ``decode`` (int8 or shared rows to the
#: pool's dtype) and ``copy`` (into the pool's slots); ``load`` = decode + copy. ``loads_first``: on
#: a CPU pool the loads run on the scheduler thread before the forward instead (``load`` counts
#: them too). ``bubble``: the forward waiting for a layer still being loaded. Disk reads and checksums are the store's
#: (``loopkv_disk_seconds``): they may run on the read-ahead thread before the match.
STAGES = ("held", "lookup", "plan", "fetch", "alloc", "loads_first", "recompute", "decode", "copy", "load", "bubble")


@dataclass(slots=True)
class RestoreStats:
    """Counters for metrics and benchmarks."""

    restores: int = 0
    recomputed_token_layers: int = 0
    loaded_token_layers: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    last_plan: list[int] = field(default_factory=list)
    last_predicted: dict = field(default_factory=dict)

    def snapshot(self) -> RestoreStats:
        return RestoreStats(self.restores, self.recomputed_token_layers, self.loaded_token_layers, dict(self.seconds))

    @property
    def recompute_fraction(self) -> float:
        total = self.recomputed_token_layers + self.loaded_token_layers
        return self.recomputed_token_layers / total if total else 0.0


def calibrate(
    stack: LayerStack, layer_bytes: int, device: torch.device, repeats: int = 2, layers: int = 4
) -> CostModel:
    """Time the model's first ``layers`` layers on dummy tokens (three sizes: a fixed, a linear and
    a quadratic term per layer; the layers of these models all cost the same) and a pool-sized copy
    on this machine (host to device on CUDA, synchronised). About 0.3 s for SmolLM2 on 2 idle cores."""

    def run(s: int) -> float:
        n = min(layers, stack.num_layers)
        plan = RestorePlan(s, (s,) * n + (0,) * (stack.num_layers - n))
        ids = torch.zeros(s, dtype=torch.int64, device=device)
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            recompute_front(stack, plan, ids, 0, lambda *a: None)
            _sync(device)  # CUDA queues the work: time its end, not its launch
            best = min(best, time.perf_counter() - t0)
        return best / n

    run(16)  # warm-up
    sizes = torch.tensor([16.0, 64.0, 384.0], dtype=torch.float64)
    times = torch.tensor([run(int(x)) for x in sizes], dtype=torch.float64)
    # t(s) = c + a s + b s^2 / 2 per layer: three sizes give c, a and b (none negative).
    c, a, b = torch.linalg.solve(torch.stack([torch.ones_like(sizes), sizes, sizes**2 / 2], 1), times).tolist()
    c, b = max(c, 0.0), max(b, 0.0)
    a = max(a, 1e-9)
    n_tok = 4096
    # what a load does: host rows (pinned on CUDA, as the host tier's) scattered into the device pool
    src = torch.empty(n_tok * layer_bytes // 4, dtype=torch.float32, pin_memory=torch.device(device).type == "cuda")
    src = src.view(n_tok, -1)
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    idx = torch.randperm(n_tok, device=device)
    dst.index_copy_(0, idx, src.to(device, non_blocking=True))
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.index_copy_(0, idx, src.to(device, non_blocking=True))
    _sync(device)
    copy = (time.perf_counter() - t0) / 3
    return CostModel(
        token_s=a, attn_s=b, layer_s=c, copy_bps=n_tok * layer_bytes / max(copy, 1e-9), source="calibrated"
    )


def _sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Restorer:
    """Plans and runs restores for one KV pool. ``stack`` gives the model's layers (None when the
    attention backend is not loopkv: then every plan is load-all)."""

    def __init__(
        self,
        planner: str | RestorePlanner = "krul",
        cost: CostModel | None = None,
        stack: Callable[[], LayerStack | None] = lambda: None,
        calibrate_on_first_use: bool = True,
    ):
        self.planner = PLANNERS.create(planner) if isinstance(planner, str) else planner
        self.cost = cost or CostModel()
        self._stack_factory, self._stack = stack, None
        self._calibrate = calibrate_on_first_use and cost is None
        self.stats = RestoreStats()
        self._lock = threading.Lock()  # stats are also updated from the loader thread

    @property
    def stack(self) -> LayerStack | None:
        if self._stack is None:
            self._stack = self._stack_factory()
        return self._stack

    def ensure_calibrated(self, layer_bytes: int, device: torch.device) -> None:
        if not self._calibrate or self.stack is None:
            return
        self._calibrate = False
        t0 = time.perf_counter()
        self.cost = calibrate(self.stack, layer_bytes, device)
        logger.info(
            "loopkv restore cost model calibrated in %.2f s: %.3g s/layer + %.3g s/token-layer + %.3g s/attention "
            "pair, copy %.2f GB/s",
            time.perf_counter() - t0,
            self.cost.layer_s,
            self.cost.token_s,
            self.cost.attn_s,
            self.cost.copy_bps / 1e9,
        )

    def plan(self, job: RestoreJob) -> RestorePlan:
        t0 = time.perf_counter()
        if self.stack is None or job.total == 0:
            plan = RestorePlan.load_all(job.total, job.num_layers)
        else:
            plan = self.planner.plan(job, self.cost)
        self.add_seconds("plan", time.perf_counter() - t0)
        return plan

    def add_seconds(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` of a resume in ``stage`` (one of :data:`STAGES`); any thread."""
        with self._lock:
            self.stats.seconds[stage] += seconds

    def recompute(self, plan: RestorePlan, job: RestoreJob, token_ids: torch.Tensor, write, prefix_kv) -> float:
        """Run the plan's recompute part; returns its wall seconds and refines the compute cost."""
        if plan.recompute_tokens == 0:
            return 0.0
        t0 = time.perf_counter()
        recompute_front(self.stack, plan, token_ids, job.prefix, write, prefix_kv)
        elapsed = time.perf_counter() - t0
        predicted = sum(self.cost.rows_s(s, job.prefix) for s in plan.recompute)
        if predicted > 0:
            f = (1 - EMA) + EMA * elapsed / predicted
            self.cost.token_s *= f
            self.cost.attn_s *= f
            self.cost.layer_s *= f
        self.add_seconds("recompute", elapsed)
        return elapsed

    def observe_copy(self, nbytes: int, decode_s: float, copy_s: float) -> None:
        """Loader thread: a layer's load finished, ``nbytes`` of pool KV decoded in ``decode_s`` and
        copied in ``copy_s``. Refines the load bandwidth the planner prices a load at: both, since
        the load stream does both."""
        seconds = decode_s + copy_s
        if nbytes > (1 << 20) and seconds > 0:
            self.cost.copy_bps = (1 - EMA) * self.cost.copy_bps + EMA * nbytes / seconds
        with self._lock:
            self.stats.seconds["decode"] += decode_s
            self.stats.seconds["copy"] += copy_s
            self.stats.seconds["load"] += seconds

    def observe_disk(self, nbytes: int, seconds: float) -> None:
        if nbytes > (1 << 20) and seconds > 0:
            self.cost.disk_bps = (1 - EMA) * self.cost.disk_bps + EMA * nbytes / seconds

    def observe_bubble(self, seconds: float) -> None:
        self.add_seconds("bubble", seconds)

    def record(self, plan: RestorePlan, job: RestoreJob) -> dict:
        tl = simulate(plan, job, self.cost)
        predicted = {
            "restored_s": tl.restored_s,
            "finish_s": tl.finish_s,
            "bubble_s": tl.bubble_s,
            "compute_s": tl.compute_s,
            "load_s": tl.load_s,
        }
        with self._lock:
            s = self.stats
            s.restores += 1
            s.recomputed_token_layers += sum(plan.recompute)
            s.loaded_token_layers += sum(plan.load(layer) for layer in range(plan.num_layers))
            s.last_plan = list(plan.recompute)
            s.last_predicted = predicted
        return predicted
