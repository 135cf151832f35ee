"""``python -m sgl_loopkv.launch_server`` in a fresh process: ``--help`` lists ours and SGLang's flags; a taken port is refused."""

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


def test_a_port_in_use_is_refused_at_once_with_a_readable_error():
    """Not after loading the model, and not by hanging: SGLang's HTTP server stops on a bind error
    while its scheduler lives on, so the process never exits."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "sgl_loopkv.launch_server", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode != 0 and f"cannot serve on 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    assert "choose --port" in proc.stderr and time.monotonic() - t0 < 120
