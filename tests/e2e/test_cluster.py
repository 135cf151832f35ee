"""Two sgl-loopkv workers sharing one disk tier behind sglang-router (issue 17), on the tiny model:
a turn that lands on the other worker resumes from the shared tier with the answer a single
server gives; a worker killed with ``kill -9`` is routed around and its conversation resumes on the
survivor; restarted (slow), it rejoins and resumes what the survivor stored meanwhile."""

from __future__ import annotations

import time

import pytest
import requests

from sgl_loopkv.server.cluster import Cluster, router_available
from tests.e2e.conftest import COMMON_SERVER_ARGS
from tests.e2e.test_tiered_cache import conversation

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not router_available(), reason="sglang-router not installed (./install.sh --test)"),
]


def generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def prompts_served(cluster: Cluster) -> list[float]:
    """Per worker: the prompt tokens it has processed (SGLang's counter on its own /metrics)."""
    out = []
    for p in cluster.procs:
        try:
            text = requests.get(f"{p.url}/metrics", timeout=10).text
        except requests.RequestException:  # a dead worker
            out.append(float("nan"))
            continue
        out.append(
            sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("sglang:prompt_tokens_total"))
        )
    return out


def turn(cluster: Cluster, ids: list[int]) -> tuple[dict, int]:
    """One request through the router, and the worker that served it."""
    before = prompts_served(cluster)
    out = generate(cluster.url, ids)
    after = prompts_served(cluster)
    (worker,) = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
    return out, worker


def details(out: dict) -> dict:
    return out["meta_info"].get("cached_tokens_details") or {}


def wait_segments(disk_dir, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(disk_dir.glob("*/seg_*.kv"))) < n:
        assert time.monotonic() < deadline, f"fewer than {n} segments reached the shared tier"
        time.sleep(0.2)


def start_cluster(model_dir, disk, log_dir, policy: str = "round_robin", **kw) -> Cluster:
    args = [
        *("--model-path", str(model_dir), *COMMON_SERVER_ARGS),
        *("--loopkv-tier-disk-dir", str(disk), "--enable-metrics"),
    ]
    log_dir.mkdir(exist_ok=True)
    kw = {"health_interval_s": 2, **kw}
    return Cluster(args, workers=2, policy=policy, threads_per_worker=1, log_dir=log_dir, **kw).start()


def new_text(model_dir) -> list[list[int]]:
    """Four turns' new tokens (300 each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(conversation(40 + t))["input_ids"][:300] for t in range(4)]


def resume_elsewhere_then_kill_9(cluster: Cluster, disk, ids, reference_url: str) -> tuple[list[int], int]:
    """Turns 1 and 2 (round robin: on the two workers), then ``kill -9`` of the worker holding the
    conversation on its device and turn 3 through the router. Returns the history and the victim."""
    history, outs, served = [], [], []
    for t in range(2):
        history += ids[t]
        out, worker = turn(cluster, history)
        assert out["output_ids"] == generate(reference_url, history)["output_ids"]  # what one server answers
        outs.append(out)
        served.append(worker)
        history += out["output_ids"]
        wait_segments(disk, t + 1)  # the turn's write-through reached the shared tier
    assert served[0] != served[1]
    shared = details(outs[1])
    assert shared.get("storage", 0) >= 256 and shared["storage_shared"] == shared["storage"], shared

    # The router routes around the dead worker, and the survivor resumes the whole history from the
    # shared tier (the victim's turn from the victim's segment).
    victim, survivor = served[1], served[0]
    cluster.kill_worker(victim)
    history += ids[2]
    before = prompts_served(cluster)[survivor]
    out = generate(cluster.url, history)
    assert prompts_served(cluster)[survivor] > before
    assert details(out)["storage_shared"] > 0, details(out)
    assert out["output_ids"] == generate(reference_url, history)["output_ids"]
    history += out["output_ids"]
    wait_segments(disk, 3)
    return history, victim


# slow (a cluster of its own, three processes): the shared disk tier between workers is
# tests/unit/test_shared_disk.py's, the router's flags tests/unit/test_cluster_launch.py's
@pytest.mark.slow
def test_round_robin_resumes_on_the_other_worker_and_survives_a_kill_9(
    tiny_server, tiny_model_dir, tmp_path, server_logs
):
    ids = new_text(tiny_model_dir)
    with start_cluster(tiny_model_dir, tmp_path / "kv", server_logs / "cluster") as cluster:
        resume_elsewhere_then_kill_9(cluster, tmp_path / "kv", ids, tiny_server.url)
        cluster.wait_healthy(1)  # the router's health checks took the dead worker out


@pytest.mark.slow  # a cluster of its own
def test_no_request_fails_when_the_worker_holding_its_conversation_is_killed(
    tiny_server, tiny_model_dir, tmp_path, server_logs
):
    """cache_aware sends a conversation back to the worker that holds it; right after that worker's
    ``kill -9`` (before any health check) the next turns are retried on the survivor and answered as
    one server would, not failed (the router's circuit breaker, set by the launcher)."""
    ids = new_text(tiny_model_dir)
    # health checks far apart: only the circuit breaker can route around the dead worker in time
    with start_cluster(
        tiny_model_dir, tmp_path / "kv", server_logs / "cluster-breaker", policy="cache_aware", health_interval_s=60
    ) as cluster:
        history = ids[0]
        out, holder = turn(cluster, history)
        history += out["output_ids"]
        wait_segments(tmp_path / "kv", 1)
        cluster.kill_worker(holder)
        for t in (1, 2):
            history += ids[t]
            out = generate(cluster.url, history)  # asserts 200
            assert out["output_ids"] == generate(tiny_server.url, history)["output_ids"]
            history += out["output_ids"]


@pytest.mark.slow  # a cluster of its own; the test above covers the resume and the kill -9
def test_a_restarted_worker_rejoins_and_resumes_what_was_stored_meanwhile(
    tiny_server, tiny_model_dir, tmp_path, server_logs
):
    ids = new_text(tiny_model_dir)
    with start_cluster(tiny_model_dir, tmp_path / "kv", server_logs / "cluster-restart") as cluster:
        history, victim = resume_elsewhere_then_kill_9(cluster, tmp_path / "kv", ids, tiny_server.url)
        cluster.wait_healthy(1)
        cluster.restart_worker(victim)
        cluster.wait_healthy(2)  # back in rotation
        history += ids[3]
        deadline = time.monotonic() + 120
        while True:  # round robin: within two requests it gets one
            out, worker = turn(cluster, history)
            if worker == victim:
                break
            assert time.monotonic() < deadline, "the restarted worker never got a request back"
            time.sleep(1.0)
        assert details(out)["storage_shared"] > 0, details(out)  # what the survivor stored while it was down
        assert out["output_ids"] == generate(tiny_server.url, history)["output_ids"]


@pytest.mark.slow  # the command as a user runs it: a cluster of its own
def test_the_launch_cluster_command_serves_chat_through_the_router_and_stops_cleanly(tiny_model_dir, tmp_path):
    """``python -m sgl_loopkv.launch_cluster`` end to end: two workers and the router come up, chat
    requests through the router's OpenAI endpoint are answered (round robin: one turn by each
    worker), and SIGTERM stops the router and every worker."""
    import re
    import signal
    import subprocess
    import sys
    import threading

    from sgl_loopkv.server.process import free_port

    port = free_port()
    cmd = [
        *(sys.executable, "-m", "sgl_loopkv.launch_cluster", "--workers", "2", "--router-policy", "round_robin"),
        *("--port", str(port), "--router-health-interval-s", "2", "--log-dir", str(tmp_path / "logs")),
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS, "--loopkv-tier-disk-dir", str(tmp_path / "kv")),
        "--enable-metrics",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not any("router (round_robin) on" in x for x in lines):
            assert proc.poll() is None, "launch_cluster exited:\n" + "".join(lines[-40:])
            assert time.monotonic() < deadline, "launch_cluster did not come up:\n" + "".join(lines[-40:])
            time.sleep(0.5)
        up = next(x for x in lines if "router (round_robin) on" in x)
        workers = re.search(r"workers (.*); logs", up).group(1).split(", ")
        assert len(workers) == 2
        url = f"http://127.0.0.1:{port}"
        model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        messages = [{"role": "user", "content": "Name three colours of the rainbow. " * 20}]
        served = []
        for _ in range(2):
            before = [_prompt_tokens(w) for w in workers]
            r = requests.post(
                f"{url}/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            served += [i for i, (b, w) in enumerate(zip(before, workers)) if _prompt_tokens(w) > b]
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "And two more?"}]
        assert sorted(served) == [0, 1]  # round robin: each worker served a turn
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, "".join(lines[-40:])
    for w in workers:  # no worker outlives the command
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{w}/health", timeout=5)


def _prompt_tokens(worker_url: str) -> float:
    text = requests.get(f"{worker_url}/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("sglang:prompt_tokens_total"))
