"""Kernels shipped by sgl-loopkv (importable as ``sgl_loopkv.kernels``).

- ``cpu_standin/``: the ``sgl_kernel`` stand-in for CPU-only machines (see its docstring and
  :mod:`sgl_loopkv.platform`). It is a plain directory put on ``sys.path``, not a subpackage import.
"""

from pathlib import Path

CPU_STANDIN_DIR = Path(__file__).resolve().parent / "cpu_standin"
