"""Two sgl-loopkv workers sharing one disk tier behind sglang-router (issue 17), on the tiny model:
a turn that lands on the other worker resumes from the shared tier with the answer a single
server gives; a worker killed with ``kill -9`` is routed around and its conversation resumes on the
survivor; restarted, it rejoins and resumes what the survivor stored meanwhile."""

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


def test_round_robin_resumes_on_the_other_worker_survives_a_kill_9_and_a_restart(
    tiny_server, tiny_model_dir, tmp_path, server_logs
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [tok(conversation(40 + t))["input_ids"][:300] for t in range(4)]  # four turns' new text
    disk = tmp_path / "shared-kv"
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS),
        *("--loopkv-disk-dir", str(disk), "--enable-metrics"),
    ]
    (server_logs / "cluster").mkdir(exist_ok=True)
    cluster = Cluster(
        args,
        workers=2,
        policy="round_robin",
        threads_per_worker=1,
        health_interval_s=2,
        log_dir=server_logs / "cluster",
    )
    with cluster.start():
        history, reference = [], []
        outs, served = [], []
        for t in range(2):  # turn 1 on one worker, turn 2 on the other (round robin)
            history += ids[t]
            out, worker = turn(cluster, history)
            reference.append(generate(tiny_server.url, history)["output_ids"])
            outs.append(out)
            served.append(worker)
            history += out["output_ids"]
            wait_segments(disk, t + 1)  # the turn's write-through reached the shared tier
        assert served[0] != served[1]
        shared = details(outs[1])
        assert shared.get("storage", 0) >= 256 and shared["storage_shared"] == shared["storage"], shared
        assert [o["output_ids"] for o in outs] == reference  # what one server answers

        # kill -9 the worker that holds the conversation on its device: the router routes around it,
        # and the survivor resumes the whole history from the shared tier.
        victim, survivor = served[1], served[0]
        cluster.kill_worker(victim)
        history += ids[2]
        before = prompts_served(cluster)[survivor]
        out = generate(cluster.url, history)
        assert prompts_served(cluster)[survivor] > before
        assert details(out)["storage_shared"] > 0, details(out)  # the victim's turn, from its segment
        assert out["output_ids"] == generate(tiny_server.url, history)["output_ids"]
        history += out["output_ids"]
        wait_segments(disk, 3)

        cluster.wait_healthy(1)  # the router's health checks took the dead worker out

        # Restarted, the worker rejoins (the router's health checks) and resumes the turn the survivor
        # stored while it was down.
        cluster.restart_worker(victim)
        cluster.wait_healthy(2)
        history += ids[3]
        deadline = time.monotonic() + 120
        while True:
            out, worker = turn(cluster, history)
            if worker == victim:
                break
            assert time.monotonic() < deadline, "the restarted worker never got a request back"
            time.sleep(1.0)
        assert details(out)["storage_shared"] > 0, details(out)
        assert out["output_ids"] == generate(tiny_server.url, history)["output_ids"]
