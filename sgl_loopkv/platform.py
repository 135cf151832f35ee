"""Which device we serve on, and the CPU stand-in for ``sgl_kernel``.

Everything here must run before SGLang's ``srt`` modules are imported: many of them evaluate
``is_cpu()`` (``SGLANG_USE_CPU_ENGINE``) and ``from sgl_kernel import ...`` at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from functools import lru_cache

logger = logging.getLogger(__name__)

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


@lru_cache(maxsize=1)
def has_cuda() -> bool:
    """True when a usable CUDA device is present (the GPU settings apply)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """True when the CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX-BF16): torch's
    oneDNN kernels then run bf16 linear layers faster than fp32 (half the bytes). Without them bf16
    is emulated and several times slower than fp32 (benchmarks/decode.py records both)."""
    return bool(set(NATIVE_BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def default_cpu_dtype() -> str:
    """float32 on every CPU. bfloat16 stays opt-in (``--dtype bfloat16``) even with native bf16:
    measured on SmolLM2 (``benchmarks/results/decode.md``) it misses the fidelity bar for making it
    the default (teacher-forced top-1 agreement with float32 >= 0.98), a resumed history's greedy
    tokens can differ from a recompute's, and with float32's linear layers on both cores it is no
    longer 1.3x faster at 4K."""
    return "float32"


def use_cpu_engine() -> None:
    """Switch SGLang to its CPU engine for this process and the processes it spawns."""
    os.environ[CPU_ENGINE_ENV] = "1"


def cpu_engine_enabled() -> bool:
    return os.environ.get(CPU_ENGINE_ENV, "").lower() in ("1", "true")


def real_sgl_kernel_available() -> bool:
    """Whether a genuine ``sgl_kernel`` imports in this process (not our stand-in)."""
    if "sgl_kernel" in sys.modules:
        return not getattr(sys.modules["sgl_kernel"], "IS_SGL_LOOPKV_STANDIN", False)
    try:
        importlib.import_module("sgl_kernel")
    except Exception:  # absent, or a CUDA build failing on libcuda.so: both mean "not usable here"
        sys.modules.pop("sgl_kernel", None)
        return False
    return True


def activate_cpu_standin() -> bool:
    """Put the ``sgl_kernel`` stand-in on the import path if SGLang's CPU engine needs one.

    Only when the CPU engine is on and the real package does not import. The directory goes on
    ``sys.path`` (multiprocessing's spawn copies it into the scheduler and detokenizer before they
    unpickle anything) and on ``PYTHONPATH`` (for children started any other way). Returns whether
    the stand-in is active. Idempotent.
    """
    from sgl_loopkv.kernels import CPU_STANDIN_DIR

    if not cpu_engine_enabled():
        return False
    standin = str(CPU_STANDIN_DIR)
    if standin in sys.path:
        return True
    if real_sgl_kernel_available():
        return False
    sys.path.append(standin)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if standin not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, standin])
    logger.info("sgl_kernel not installed: using sgl-loopkv's CPU stand-in (%s)", standin)
    return True


def keep_torch_on_this_thread() -> bool:
    """Make the calling helper thread run its torch ops on itself, without an OpenMP team.

    Call it first thing in any long-lived thread that runs torch ops beside the forward (the
    loader, the disk writer). With libgomp, the first parallel op on a thread outside the main team
    gives that thread a team of its own, whose workers live as long as the process. Once libgomp
    manages more threads than there are CPUs it stops spinning between parallel regions, so every
    op of the forward has to wake its worker through the kernel: on 2 cores that made decode after
    the first resume or disk write slower than stock SGLang, and it stayed so
    (docs/decisions/2026-11-24-helper-threads-out-of-openmp.md).
    ``torch.set_num_threads(1)`` would also lower the default of every thread started later (it is
    process-wide), so only this thread's OpenMP setting is changed. False where the OpenMP runtime
    is not libgomp (torch's threads are then left alone)."""
    import torch

    torch.get_num_threads()  # this thread's lazy init first: it would overwrite the setting below
    gomp = _gomp()
    if gomp is None:
        return False
    gomp.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


@contextlib.contextmanager
def torch_single_threaded() -> Iterator[None]:
    """Run the block's torch ops on the calling thread alone (libgomp's per-thread setting, put back
    after). For bulk copies between forwards on the scheduler thread (a finished turn's store): there
    the tokenizer and HTTP processes are busy with the next request, and a parallel op whose second
    OpenMP thread is preempted waits a scheduler slice at its barrier. A 2K-token turn's gather (60
    per-layer copies) took 285-312 ms so in the server against 24 ms alone; one thread, with a busy
    process beside it, 39 ms (docs/decisions/2026-11-24-helper-threads-out-of-openmp.md)."""
    gomp = _gomp()
    if gomp is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    gomp.omp_set_num_threads(1)
    try:
        yield
    finally:
        gomp.omp_set_num_threads(before)


@lru_cache(maxsize=1)
def _gomp():
    import ctypes

    import torch

    torch.get_num_threads()  # torch's per-thread lazy init first: it would overwrite a setting made before
    try:
        return ctypes.CDLL("libgomp.so.1")  # the copy torch loaded (same soname): its runtime
    except OSError:
        return None


#: Nice value of threads whose work can wait for the forward (the disk writer).
BACKGROUND_NICE = 10


def yield_cpu_to_the_forward() -> bool:
    """Lower the calling thread's scheduling priority (Linux: nice is per thread) so that, on a
    machine whose cores the forward's threads use, this thread runs when they leave a core free
    instead of taking it from them. Why: the disk writer's crc32 and writes of a 2K-token turn (~94 MB
    in float32) ran during the next request's prefill and slowed it
    (docs/decisions/2026-11-26-two-disk-writers.md). False where the priority cannot be set."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        return False
    return True


def thread_priority() -> int:
    """The calling thread's nice value (0 where it cannot be read)."""
    import threading

    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return 0


def take_cpu_back(nice: int) -> bool:
    """Undo :func:`yield_cpu_to_the_forward` for the calling thread: back to ``nice`` (what
    :func:`thread_priority` read before). False where that is not allowed: raising a priority needs
    ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` that permits it), which a container often drops; the
    thread then stays lowered."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        return False
    return True


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``); False without glibc.

    Why: the tiers allocate and free tensors of a few MB all the time (segments stored, promoted,
    read from disk, copied by the writer thread). glibc serves them from its heaps once its mmap
    threshold has risen past their size, and freed heap pages in the middle of a heap stay in the
    process's RSS: in a 10-minute soak the server's RSS crept up by ~150 MB beyond the host tier's
    bytes. A trim costs ~10 ms (call it at most every few seconds, off the forward)."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


@lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None
