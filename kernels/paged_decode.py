"""The CPU paged-decode kernel (``paged_decode.cpp``), compiled once per machine with torch's
C++ extension builder and cached under the user cache dir.

Why a kernel: in torch alone a decode step over a fragmented pool either loops over slot runs
(two small matmuls per run) or gathers the whole prefix first (a second copy of the KV per layer).
The kernel reads each key and value row in place, once, for every sequence of the batch in one call.

:func:`load` returns the compiled module or None (no compiler, build failure, not a CPU build of
torch, or ``LOOPKV_NATIVE_DECODE=0``); callers then keep the torch paths. Build once ahead of the
server with ``python -m sgl_loopkv.kernels.paged_decode`` (``install.sh`` does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "paged_decode.cpp"
ENV_SWITCH = "LOOPKV_NATIVE_DECODE"

_lock = threading.Lock()
_module = None
_tried = False


def _cpu_key() -> str:
    """Build key: the kernel is compiled with -march=native, so a cache dir shared between
    machines must not hand one CPU's binary to another."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:10]


def build_dir() -> Path:
    from sgl_loopkv.config import default_cache_dir

    return default_cache_dir() / "torch_extensions" / f"paged_decode_{_cpu_key()}"


def load(verbose: bool = False):
    """The compiled extension (``.paged_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale,
    out, min_split)``), or None when it cannot be had here. Thread-safe; tries once per process."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get(ENV_SWITCH, "1") == "0":
            logger.info("loopkv: native paged decode disabled (%s=0)", ENV_SWITCH)
            return None
        try:
            from torch.utils.cpp_extension import load as load_extension

            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            _module = load_extension(
                name="loopkv_paged_decode",
                sources=[str(SOURCE)],
                # -fopenmp: at::parallel_for is a header template that runs serially unless the
                # extension itself is compiled with OpenMP. The link resolves to the libgomp.so.1
                # torch already loaded (same soname): one thread pool, torch's.
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                verbose=verbose,
            )
        except Exception as e:  # no compiler / ninja / headers: the torch paths still work
            logger.warning("loopkv: native paged decode unavailable (%s); using the torch decode paths", e)
            _module = None
        return _module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    module = load(verbose=True)
    print(f"paged_decode: {'built' if module is not None else 'NOT available'} in {build_dir()}")
    raise SystemExit(0 if module is not None else 1)
