"""``python -m sgl_loopkv.launch_server --help`` in a fresh process: ours and SGLang's flags."""

from __future__ import annotations

import subprocess
import sys


def test_help_lists_loopkv_and_sglang_flags():
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_loopkv.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--loopkv-cache-dir" in proc.stdout and "--loopkv-device" in proc.stdout
    assert "--attention-backend" in proc.stdout and "--radix-cache-backend" in proc.stdout
