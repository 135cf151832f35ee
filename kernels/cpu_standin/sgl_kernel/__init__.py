"""CPU stand-in for ``sgl_kernel``, put on ``sys.path`` by sgl-loopkv only when the real package
is not importable and SGLang runs its CPU engine (``SGLANG_USE_CPU_ENGINE=1``).

Why it exists: with the CPU engine on, about six SGLang 0.5.23 modules run
``from sgl_kernel import <name>_cpu`` at import time (kv-cache moves, allocation, speculative
decoding helpers). On a CPU without the sgl-kernel CPU build, SGLang otherwise runs plain torch:
every real kernel call is gated on ``cpu_has_amx_support()``, which needs a registered
``torch.ops.sgl_kernel.convert_weight_packed``. This module registers **no** torch ops, so that
gate stays False even on an AMX machine, and SGLang keeps its plain-torch paths.

Contract:
- ``from sgl_kernel import X_cpu`` succeeds for any name ending in ``_cpu``; anything else raises
  ImportError exactly as if the name did not exist (so feature probes stay truthful).
- Calling a stand-in raises NotImplementedError naming the op: never a silent wrong answer.
- With ``LOOPKV_STANDIN_TRACE=<file>`` each name resolved (``import <name>``) and each call
  (``call <name>``) is appended to that file with the process id, so tests can prove that the
  stand-in reached the scheduler and that no op ran.
"""

import os

__version__ = "0.0.0+sgl-loopkv-cpu-standin"
IS_SGL_LOOPKV_STANDIN = True


def _trace(event: str, name: str) -> None:
    path = os.environ.get("LOOPKV_STANDIN_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event} {name}\n")


class StandInOp:
    """A named placeholder for a kernel this build does not have."""

    def __init__(self, name: str):
        self.__name__ = self.name = name

    def __call__(self, *args, **kwargs):
        _trace("call", self.name)
        raise NotImplementedError(
            f"sgl_kernel.{self.name} was called, but this process uses sgl-loopkv's CPU stand-in for "
            "sgl_kernel (the sgl-kernel CPU build is not installed). SGLang should have taken its "
            "plain-torch path here; please report the flags that led to this call."
        )

    def __repr__(self) -> str:
        return f"<sgl-loopkv stand-in for sgl_kernel.{self.name}>"


def __getattr__(name: str):
    if name.startswith("__") or not name.endswith("_cpu"):
        raise AttributeError(f"module 'sgl_kernel' (sgl-loopkv CPU stand-in) has no attribute {name!r}")
    _trace("import", name)
    op = StandInOp(name)
    globals()[name] = op  # resolve once per process
    return op
