"""Build and load sgl-loopkv's C++ kernels (this folder's ``*.cpp``) with torch's extension builder:
compiled once per machine with ``-march=native`` and cached under the user cache dir.

:meth:`NativeExtension.load` returns the compiled module or None (no compiler, build failure, not a
CPU build of torch, or the extension's environment switch set to ``0``); callers then keep their
torch paths. ``python -m sgl_loopkv.kernels.paged_decode`` builds every extension ahead of the
server (``install.sh`` does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
# -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself is
# compiled with OpenMP; the link resolves to the libgomp.so.1 torch already loaded (one thread pool).
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ["-fopenmp"]


def _build_key(source: Path) -> str:
    """Build key. The CPU's: the kernels are compiled with -march=native, so a cache dir shared
    between machines must not hand one CPU's binary to another. The source's path and torch's
    version: ninja rebuilds whenever the build command changes, and the command names both, so two
    checkouts (a CI checkout and a developer's, a benchmark's worktree) sharing one directory would
    rebuild each other's kernels (~60 s on 2 cores) at every server start that follows the other's.
    torch's path as the command spells it (its include dirs): a worktree that links the same venv
    under another path would otherwise flip the command, and rebuild, at every start that follows
    a start from the other path (seen 2026-11-29: 65 s start-ups)."""
    import torch

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = "\0".join((platform.machine(), flags, str(source), torch.__version__, os.path.abspath(torch.__file__)))
    return hashlib.sha256(key.encode()).hexdigest()[:10]


class NativeExtension:
    """One C++ source of this folder built as the torch extension ``loopkv_<stem>``."""

    def __init__(self, stem: str, env_switch: str, what: str, extra_cflags: tuple[str, ...] = ()):
        self.stem, self.env_switch, self.what = stem, env_switch, what
        self.extra_cflags = list(extra_cflags)
        self.source = HERE / f"{stem}.cpp"
        self._lock = threading.Lock()
        self._module = None
        self._tried = False

    def build_dir(self) -> Path:
        from sgl_loopkv.paths import default_cache_dir

        return default_cache_dir() / "torch_extensions" / f"{self.stem}_{_build_key(self.source)}"

    def load(self, verbose: bool = False):
        """The compiled module, or None when it cannot be had here. Thread-safe; tries once per process."""
        if self._tried:
            return self._module
        with self._lock:
            if self._tried:
                return self._module
            self._tried = True
            if os.environ.get(self.env_switch, "1") == "0":
                logger.info("loopkv: native %s disabled (%s=0)", self.what, self.env_switch)
                return None
            try:
                from torch.utils.cpp_extension import load as load_extension

                out = self.build_dir()
                out.mkdir(parents=True, exist_ok=True)
                self._module = load_extension(
                    name=f"loopkv_{self.stem}",
                    sources=[str(self.source)],
                    extra_cflags=[*CFLAGS, *self.extra_cflags],
                    extra_ldflags=LDFLAGS,
                    build_directory=str(out),
                    verbose=verbose,
                )
            except Exception as e:  # no compiler / ninja / headers: the torch paths still work
                logger.warning("loopkv: native %s unavailable (%s); using the torch paths", self.what, e)
                self._module = None
            return self._module


def all_extensions() -> list[NativeExtension]:
    """Every extension of this folder: one per ``<stem>.cpp``, the ``EXTENSION`` of the module
    ``sgl_loopkv.kernels.<stem>``. What ``python -m sgl_loopkv.kernels.paged_decode`` builds, so a new
    kernel is prebuilt by ``install.sh`` without being listed anywhere (no server start compiles it)."""
    import importlib

    return [importlib.import_module(f"sgl_loopkv.kernels.{p.stem}").EXTENSION for p in sorted(HERE.glob("*.cpp"))]
