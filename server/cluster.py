"""``python -m sgl_loopkv.launch_cluster``: N sgl-loopkv workers that share one disk tier, behind
SGLang's router (``sglang-router``, the ``router`` extra).

    python -m sgl_loopkv.launch_cluster --workers 2 --router-policy round_robin [worker flags ...]

Every flag that is not the cluster's own passes through to each worker unchanged (so every
``sglang.launch_server`` and ``--loopkv-*`` flag works as it does for one server). What the
cluster adds:

- Ports: workers on free loopback ports (printed), the router on ``--host``/``--port``.
- CPU: the machine's cores split between the workers (``--threads-per-worker``, default cores /
  workers): each worker is pinned to its own cores (``sched_setaffinity``, inherited by SGLang's
  subprocesses) and sizes OpenMP to them, so N workers do not fight over every core.
- One disk tier: every worker gets the same ``--loopkv-tier-disk-dir`` (the flag's own default,
  ``<cache-dir>/kv``, unless given), which the workers share safely (:mod:`sgl_loopkv.cache.disk`):
  a conversation the router sends to another worker resumes from what the first one stored.
- The per-client request limit of the workers is off (``--loopkv-limit-max-client-requests 0``): behind
  the router every request comes from the router's address; limit clients at the router
  (``--router-args "--max-concurrent-requests N"``).
- Failures: the router's circuit breaker (3 failed attempts) and its health checks (every
  ``--router-health-interval-s``) take a dead worker out of rotation, so a request that was on its
  way there is retried on another worker instead of failing; this launcher restarts it (same port,
  same disk tier), and it rejoins when its health checks pass again, seeing everything the others
  stored meanwhile.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from sgl_loopkv.server.launch import with_defaults
from sgl_loopkv.server.process import ServerProcess, free_port

logger = logging.getLogger("sgl_loopkv.cluster")

# sglang_router.launch_router --policy choices (0.3.x) that fit a set of identical workers
# ("manual" needs a routing key per request; "bucket" is for prefill-decode disaggregation).
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
INSTALL_HINT = (
    "sglang-router is not installed in this environment; install it with "
    "`pip install 'sgl-loopkv[router]'` (or `pip install sglang-router`)"
)


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def cpu_split(n_workers: int, per_worker: int | None = None) -> list[tuple[int, ...]]:
    """Cores of this process's affinity, ``per_worker`` each (default: an even split, at least one),
    assigned round the list when there are fewer cores than workers ask for."""
    cores = sorted(os.sched_getaffinity(0))
    k = per_worker or max(len(cores) // n_workers, 1)
    return [tuple(cores[(i * k + j) % len(cores)] for j in range(k)) for i in range(n_workers)]


@dataclass
class Cluster:
    """N workers (:class:`ServerProcess`) and the router in front of them, on this machine."""

    worker_args: list[str]
    workers: int = 2
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    threads_per_worker: int | None = None
    health_interval_s: int = 5
    router_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    procs: list[ServerProcess] = field(default_factory=list)
    router: subprocess.Popen | None = None

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, not {self.workers}")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}, not {self.policy!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _log(self, name: str) -> Path | None:
        return self.log_dir / f"{name}.log" if self.log_dir else None

    def start(self, timeout_s: float = 600) -> Cluster:
        if not router_available():
            raise RuntimeError(INSTALL_HINT)
        args = with_defaults(self.worker_args, {"--loopkv-limit-max-client-requests": "0"})
        for i, cpus in enumerate(cpu_split(self.workers, self.threads_per_worker)):
            env = {**self.env, "OMP_NUM_THREADS": str(len(cpus))}
            # private_disk_dir=False: the workers share the tier the flags name (the launcher's default).
            proc = ServerProcess(args, env=env, log_path=self._log(f"worker{i}"), private_disk_dir=False, cpus=cpus)
            self.procs.append(proc.spawn())  # all at once: start-ups overlap
        try:
            for proc in self.procs:
                proc.wait_ready(timeout_s)
            self._start_router(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_router(self, timeout_s: float) -> None:
        defaults = {
            "--health-check-interval-secs": str(self.health_interval_s),
            "--health-failure-threshold": "2",
            # A worker's /health runs a one-token generation that waits for the batch in progress: a long
            # prefill on one core must not look like a dead worker (a dead one refuses at once).
            "--health-check-timeout-secs": "30",
            # Until the health checks take a dead worker out (up to two intervals), cache_aware keeps
            # routing its conversations to it, and each request failed (500) once its 5 attempts had
            # gone there: the default breaker opens after 10 failures, two requests. At 3,
            # the first request's 4th attempt goes to a live worker: none failed after a kill -9
            # (docs/decisions/2026-11-27-router-circuit-breaker.md). A restarted worker is tried again after 10 s.
            "--cb-failure-threshold": "3",
            "--cb-timeout-duration-secs": "10",
            "--log-level": "warn",
        }
        cmd = [
            *(sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port)),
            *("--policy", self.policy, "--worker-urls", *(p.url for p in self.procs)),
            *with_defaults(self.router_args, defaults),
        ]
        log = open(self._log("router"), "w") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it)
        self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited with code {self.router.returncode}; log: {self._log('router')}")
            if self.healthy_workers() == self.workers:  # its health checks passed for every worker
                return
            time.sleep(0.5)
        raise TimeoutError(f"the router is not ready after {timeout_s} s; log: {self._log('router')}")

    def healthy_workers(self) -> int | None:
        """How many workers the router routes to now (its ``/readiness``); None while it does not answer."""
        try:
            return requests.get(f"{self.url}/readiness", timeout=5).json()["healthy_workers"]
        except (requests.RequestException, ValueError, KeyError):
            return None

    def wait_healthy(self, n: int, timeout_s: float = 120) -> None:
        """Until the router routes to exactly ``n`` workers (a dead one taken out, a restarted one back)."""
        deadline = time.monotonic() + timeout_s
        while self.healthy_workers() != n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the router routes to {self.healthy_workers()} workers, not {n}, after {timeout_s} s"
                )
            time.sleep(0.5)

    def dead_workers(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.proc is not None and p.proc.poll() is not None]

    def kill_worker(self, i: int) -> None:
        """``kill -9`` of worker ``i`` and its subprocesses (a crash, for drills and tests)."""
        os.killpg(self.procs[i].proc.pid, signal.SIGKILL)
        self.procs[i].proc.wait(30)

    def restart_worker(self, i: int, timeout_s: float = 600) -> None:
        """Start worker ``i`` again on its port; the router's health checks take it back in."""
        proc = self.procs[i]
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()
        proc.spawn().wait_ready(timeout_s)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGTERM)
            try:
                self.router.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.router.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.stop()

    def __enter__(self) -> Cluster:
        return self.start() if not self.procs else self

    def __exit__(self, *exc) -> None:
        self.stop()


def cluster_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_loopkv.launch_cluster",
        description="N sgl-loopkv workers sharing one disk tier behind sglang-router. Every other flag is "
        "passed to each worker (see python -m sgl_loopkv.launch_server --help).",
    )
    parser.add_argument("--workers", type=int, default=2, help="number of worker servers (default 2)")
    parser.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES, help="sglang-router policy")
    parser.add_argument("--host", default="127.0.0.1", help="address the router binds (workers stay on loopback)")
    parser.add_argument("--port", type=int, default=30000, help="the router's port (default 30000)")
    parser.add_argument(
        "--threads-per-worker", type=int, default=None, help="CPU cores per worker (default: even split)"
    )
    parser.add_argument("--router-health-interval-s", type=int, default=5, help="router health checks (default 5 s)")
    parser.add_argument("--router-args", default="", help="more sglang_router.launch_router flags, one string")
    parser.add_argument("--log-dir", type=Path, default=None, help="worker and router logs (default: a temp dir)")
    parser.add_argument("--no-restart", action="store_true", help="do not restart a worker that died")
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, worker_args = cluster_parser().parse_known_args(argv)
    if not router_available():
        sys.exit(f"launch_cluster: {INSTALL_HINT}")
    if ns.workers < 1:
        sys.exit(f"launch_cluster: --workers must be at least 1, not {ns.workers}")
    if ns.log_dir is not None:  # a new folder is fine: the workers' log files open in it
        ns.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(
        worker_args,
        workers=ns.workers,
        policy=ns.router_policy,
        host=ns.host,
        port=ns.port,
        threads_per_worker=ns.threads_per_worker,
        health_interval_s=ns.router_health_interval_s,
        router_args=shlex.split(ns.router_args),
        log_dir=ns.log_dir or Path(tempfile.mkdtemp(prefix="sgl-loopkv-cluster-")),
    )
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    cluster.start()
    logger.info(
        "router (%s) on %s; workers %s; logs in %s",
        ns.router_policy,
        cluster.url,
        ", ".join(p.url for p in cluster.procs),
        cluster.log_dir,
    )
    try:
        while not stopping:
            if cluster.router.poll() is not None:
                logger.error("the router exited (code %s): stopping the workers", cluster.router.returncode)
                break
            for i in cluster.dead_workers():
                logger.warning(
                    "worker %d (%s) exited with code %s", i, cluster.procs[i].url, cluster.procs[i].proc.returncode
                )
                if ns.no_restart:
                    cluster.procs[i].proc = None  # reported once
                    continue
                try:
                    cluster.restart_worker(i)
                    logger.info(
                        "worker %d restarted on %s; the router's health checks take it back", i, cluster.procs[i].url
                    )
                except (RuntimeError, TimeoutError) as e:
                    logger.error("worker %d did not restart: %s", i, e)
            time.sleep(1.0)
    finally:
        cluster.stop()
