"""Test infrastructure for the one-run GPU check (issue 56): a CUDA stand-in for ``sgl_kernel``
(``sgl_kernel/``), a probe that imports SGLang's Llama path as if CUDA were present
(``probe.py``). The product targets the real ``sgl-kernel``; nothing here is installed with it."""

from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent  # put this on sys.path: it holds ``sgl_kernel/``
