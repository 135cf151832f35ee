"""Run a snippet in a fresh interpreter (for code that mutates sys.path, the environment or
SGLang's import-time state) and return what it printed as JSON; scans of the disk tier's files for token ids."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable


def run_fresh(code: str, env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()) -> dict:
    return start_fresh(code, env, drop_env)()


def start_fresh(code: str, env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()) -> Callable[[], dict]:
    """:func:`run_fresh` started now and awaited by the returned function: snippets started together
    import SGLang side by side (one core each) instead of one after another."""
    full_env = {k: v for k, v in os.environ.items() if k not in drop_env}
    # a fresh process starts without the stand-in: an earlier in-process test may have activated it,
    # which appends it to this process's PYTHONPATH (for its children)
    from sgl_loopkv.kernels import CPU_STANDIN_DIR

    paths = [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(CPU_STANDIN_DIR)]
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    full_env.update(env or {})
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @functools.cache  # a result may be read by more than one test
    def result() -> dict:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0, f"snippet failed:\n{err[-4000:]}"
        return json.loads(out.strip().splitlines()[-1])

    return result


def stream_in_background(url: str, max_new_tokens: int, timeout_s: float = 60):
    """Start a ``/generate`` stream of ``max_new_tokens`` (EOS ignored) on a thread and wait
    until it is generating. Returns (thread, meta): ``meta`` holds the latest record's ``meta_info``
    (``finish_reason`` once the stream ended)."""
    import threading
    import time

    import requests

    meta: dict = {}

    def stream():
        body = {"text": "go", "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
        with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    meta.update(json.loads(line[len(b"data: ") :])["meta_info"])

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not meta and time.monotonic() < deadline:
        time.sleep(0.2)
    assert meta, "the stream never started"
    return t, meta


def files_holding(root, token_runs: list[list[int]]) -> list[str]:
    """Files under ``root`` whose bytes hold one of the runs of token ids as JSON (segment headers keep
    them so), whole ids only (``29, 35`` does not match inside ``129, 35``); a file renamed or evicted
    while the scan reads the directory is skipped."""
    needles = [", ".join(map(str, r)).encode() for r in token_runs]
    out = []
    for f in root.rglob("*"):
        try:
            if f.is_file() and _holds_any(f.read_bytes(), needles):
                out.append(str(f))
        except FileNotFoundError:
            continue
    return out


def _holds_any(data: bytes, needles: list[bytes]) -> bool:
    """Whether one of ``needles`` occurs in ``data`` between non-digits. ``bytes.find`` rather than a
    regex: a pattern that starts with a lookbehind is tried at every byte (seconds per MB-sized file)."""
    for n in needles:
        i = data.find(n)
        while i != -1:
            if not data[i - 1 : i].isdigit() and not data[i + len(n) : i + len(n) + 1].isdigit():
                return True
            i = data.find(n, i + 1)
    return False


def wait_for_disk(root, token_runs: list[list[int]], timeout_s: float = 30) -> None:
    """Until a file under ``root`` holds one of ``token_runs`` (the disk tier's writes are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while not files_holding(root, token_runs):
        assert time.monotonic() < deadline, "the tokens never reached the disk tier"
        time.sleep(0.2)
