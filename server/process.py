"""Run a server as a child process: free port, readiness wait, log file, clean shutdown.

Used by the tests, the benchmarks and the examples, so every one of them starts servers the same
way a user does (``python -m sgl_loopkv.launch_server`` or stock ``python -m sglang.launch_server``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from sgl_loopkv.config import LoopKVConfig

#: Where :func:`free_port` picks. Not the kernel's ephemeral range (32768+ by default): a port picked
#: there is free only until the server binds it, and meanwhile any socket bound to port 0 can take it
#: (an outgoing connection, or gloo's listeners in another worker's scheduler: a cluster benchmark's
#: third worker once found its port taken so and never came up). Not SGLang's own range for the ports
#: it binds later either (22000-29999, ``get_free_port_below_ephemeral``).
PORT_RANGE = (15000, 21999)
_handed: set[int] = set()  # picked by this process already: two servers started together never share one


def free_port() -> int:
    """A loopback port that nothing listens on now, for a server about to start (see PORT_RANGE)."""
    lo, hi = PORT_RANGE
    for port in random.sample(range(lo, hi + 1), min(64, hi - lo + 1)):
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # the range is full: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A server on 127.0.0.1:<port>. ``module`` is what ``python -m`` runs.

    With ``private_disk_dir``, an sgl-loopkv server whose args name no ``--loopkv-tier-disk-dir`` gets a
    fresh temporary one (removed at :meth:`stop`) instead of the launcher's default in the user cache:
    tests and benchmarks run with the disk tier on, as users do, but never resume one another's
    stored KV, and two servers of one model never meet on one directory lock."""

    args: list[str]
    module: str = "sgl_loopkv.launch_server"
    env: dict[str, str] = field(default_factory=dict)
    base_env: dict[str, str] | None = None  # the environment ``env`` is added to (default: os.environ now)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    startup_s: float | None = None  # spawn -> first successful /generate and /health (seconds)
    headers: dict[str, str] = field(default_factory=dict)  # of the readiness probe (e.g. an API key)
    private_disk_dir: bool = True
    disk_dir: Path | None = None  # the temporary disk-tier directory this object made, if any
    cpus: tuple[int, ...] | None = None  # CPU cores the server and its subprocesses may run on (Linux)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600) -> ServerProcess:
        t0 = time.perf_counter()
        self.spawn()
        self.wait_ready(timeout_s)
        self.startup_s = time.perf_counter() - t0
        return self

    def spawn(self) -> ServerProcess:
        """Start the process without waiting for it (:meth:`wait_ready` waits)."""
        env = {**(os.environ if self.base_env is None else self.base_env), **self.env}
        args = list(self.args)
        named = any(a.startswith(f) for f in LoopKVConfig.spellings("--loopkv-tier-disk-dir") for a in args)
        if self.private_disk_dir and self.module == "sgl_loopkv.launch_server" and not named:
            self.disk_dir = self.disk_dir or Path(tempfile.mkdtemp(prefix="loopkv-disk-"))  # kept over a restart
            args += ["--loopkv-tier-disk-dir", str(self.disk_dir)]
        cmd = [sys.executable, "-m", self.module, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        mode = "a" if self.proc else "w"  # a restart appends to the log
        log = open(self.log_path, mode) if self.log_path else subprocess.DEVNULL
        cpus = self.cpus
        # Own process group: SGLang's scheduler/detokenizer children go down with it. The CPU affinity is
        # inherited by them (and OpenMP sizes its team from it).
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}; log: {self.log_path}")
            try:
                r = requests.post(
                    f"{self.url}/generate",
                    json={"text": "ready?", "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                    headers=self.headers,
                    timeout=60,
                )
                # /generate answers before SGLang's own warm-up is over; /health says 503 until then
                if r.status_code == 200 and requests.get(f"{self.url}/health", timeout=60).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout_s} s; log: {self.log_path}")

    def pids(self) -> list[int]:
        """The server's process and all its descendants."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return []
        root = psutil.Process(self.proc.pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]

    def stop(self) -> None:
        try:
            self._stop_process()
        finally:
            if self.disk_dir is not None:
                shutil.rmtree(self.disk_dir, ignore_errors=True)
                self.disk_dir = None

    def _stop_process(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the launcher is gone; make sure no child outlives it
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
