"""The environment record every result carries: when, which commit, which machine, how loaded.

Detected at run time (never typed): the CPU model and the flags that decide the dtype, cores, torch
threads, load average, and the Python/torch/SGLang versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def git_state() -> dict:
    """HEAD and the tracked files modified in the work tree (empty strings without git)."""
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    try:
        return {"commit": run("rev-parse", "HEAD"), "dirty_files": run("status", "--porcelain", "--untracked-files=no")}
    except OSError:
        return {"commit": "", "dirty_files": ""}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> dict:
    """The flags that decide the dtype (the launcher's rule: :mod:`sgl_loopkv.platform`)."""
    from sgl_loopkv import platform as lp

    flags = lp.cpu_flags()
    return {k: k in flags for k in FLAGS} | {"native_bf16": lp.cpu_has_native_bf16(flags)}


def _version(dist: str) -> str | None:
    """The installed distribution's version, read from its metadata (importing SGLang takes seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """The record at the start of a run; :func:`finish` adds its end."""
    import torch

    from benchmarks.common import kernel_build_seconds

    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sglang": _version("sglang"),
        "kernel_prebuild_s": kernel_build_seconds(),
        "loadavg_start": os.getloadavg()[0],
        "git": git_state(),
        "t_start": time.monotonic(),
    }


def finish(env: dict) -> dict:
    """``env`` with the run's end: load average, wall seconds, the commit then."""
    t0 = env.pop("t_start", None)
    env |= {"loadavg_end": os.getloadavg()[0], "git_end": git_state()}
    if t0 is not None:
        env["wall_s"] = time.monotonic() - t0
    return env


def load1(v) -> float:
    """The 1-minute load average of a record (older results stored all three)."""
    return v[0] if isinstance(v, list | tuple) else v


def flags_summary(env: dict) -> str:
    """``avx2, avx512f, native_bf16``: the CPU flags a record found set."""
    return ", ".join(k for k, v in (env.get("cpu_flags") or {}).items() if v) or "not recorded"


def machine_label(env: dict | None = None) -> str:
    """``x86_64 CPU (2 cores)``: the machine of a record (this one without)."""
    env = env or {"machine": platform.machine(), "cpu_count": os.cpu_count()}
    cores = env.get("cpu_count") or env.get("cores")
    return f"{env.get('machine')} CPU" + (f" ({cores} cores)" if cores else "")
