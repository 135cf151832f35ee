"""Run a snippet in a fresh interpreter (for code that mutates sys.path, the environment or
SGLang's import-time state) and return what it printed as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def run_fresh(code: str, env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in drop_env}
    # a fresh process starts without the stand-in: an earlier in-process test may have activated it,
    # which appends it to this process's PYTHONPATH (for its children)
    from sgl_loopkv.kernels import CPU_STANDIN_DIR

    paths = [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(CPU_STANDIN_DIR)]
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"snippet failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
