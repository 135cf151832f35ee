"""CUDA stand-in for ``sgl_kernel``: TEST INFRASTRUCTURE for the one-run GPU check (issue 56), where
the real wheel (~356 MiB) does not fit in what a GPU call may carry. Never installed for users.

Contract:
- Exactly the names SGLang 0.5.23 imports at import time on the Llama serving path under CUDA
  (``tests/gpu_standin/probe.py`` finds them; ``tests/unit/test_gpu_standin.py`` checks the list).
  Any other name raises ImportError as if absent, so SGLang's feature probes take their fallbacks.
- With ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` and ``--sampling-backend pytorch`` the forward calls
  none of them; the few that a path may still reach are torch-backed (``ops.py``) and equal a torch
  reference. The others raise NotImplementedError naming the op: never a silent wrong answer.
- ``LOOPKV_STANDIN_TRACE=<file>`` appends ``<pid> call <name>`` for each call, as the CPU stand-in.
"""

from sgl_kernel.ops import TORCH_BACKED, placeholder

__version__ = "0.0.0+sgl-loopkv-cuda-standin"
IS_SGL_LOOPKV_STANDIN = True

#: Imported by SGLang at import time but not called on the Llama path with the flags above.
PLACEHOLDERS = ("int8_scaled_mm", "moe_sum_reduce")

globals().update(TORCH_BACKED)
globals().update({name: placeholder(name) for name in PLACEHOLDERS})
