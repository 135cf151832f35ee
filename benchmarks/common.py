"""Shared benchmark plumbing: timed requests, synthetic token streams, medians, and the
JSON + markdown + PNG outputs every benchmark writes under benchmarks/results/."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import requests

RESULTS = Path(__file__).resolve().parent / "results"

_WORDS = (
    "the river city morning report council water bridge market season letter garden road winter museum "
    "station harbour festival library engine signal forest valley summer teacher window history number"
).split()


def synthetic_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` token ids of plain English-like text, deterministic by seed."""
    rng = random.Random(seed)
    text = []
    while True:
        text.append(" ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ".")
        ids = tokenizer(" ".join(text), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens]


def timed_generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    """Stream one greedy request; returns ttft_s (first chunk), total_s, tokens and meta_info."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    ttft, last = None, None
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or line == b"data: [DONE]":
                continue
            ttft = ttft or time.perf_counter() - t0
            last = json.loads(line[len(b"data: ") :])
    total = time.perf_counter() - t0
    return {
        "ttft_s": ttft,
        "total_s": total,
        "tokens": len(last["output_ids"]),
        "output_ids": last["output_ids"],
        "meta_info": last["meta_info"],
    }


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a result header or a byte ratio needs to know about the served model, read from its
    config.json (never typed into a benchmark)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of one token's K and V over all layers in a KV pool of ``dtype_bytes``-byte elements."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def model_facts(model_dir: str | Path, name: str | None = None) -> ModelFacts:
    """``name``: the served model name (default: the folder's)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return ModelFacts(
        name=name or Path(model_dir).name,
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
    )


def cpu_pool_dtype(server_flags: list[str] = ()) -> tuple[str, int]:
    """The KV pool dtype a CPU server started with ``server_flags`` runs (the launcher's default
    unless ``--dtype`` is among the flags) and its element size in bytes."""
    import torch

    from sgl_loopkv.platform import default_cpu_dtype

    flags = list(server_flags)
    name = flags[flags.index("--dtype") + 1] if "--dtype" in flags else default_cpu_dtype()
    return name, getattr(torch, name).itemsize


def machine_label() -> str:
    """``x86_64 CPU (2 cores)``: this machine, for result headers."""
    return f"{platform.machine()} CPU ({os.cpu_count()} cores)"


def median(xs) -> float:
    return float(statistics.median(xs))


def prebuild_kernels() -> float:
    """Compile this checkout's C++ kernels before any server is started and timed; the seconds it
    took (~2 s when they are built). Their build cache is keyed by the source's and torch's paths
    (kernels/native.py), so in a fresh checkout or a benchmark's worktree the first server would
    otherwise compile them (~40-60 s on 2 cores) inside its start-up, which install.sh does ahead of
    time for a user (a 2026-11-29 serve_smoke run timed sgl-loopkv's start-up at 65 s vs stock's 21)."""
    import subprocess
    import sys

    global _KERNEL_BUILD_S
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sgl_loopkv.kernels.paged_decode"], capture_output=True, check=False)
    _KERNEL_BUILD_S = time.perf_counter() - t0
    return _KERNEL_BUILD_S


_KERNEL_BUILD_S: float | None = None  # environment() reports it: a run's results say the build was not timed


def environment() -> dict:
    import torch

    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "kernel_prebuild_s": _KERNEL_BUILD_S,
    }


def write_results(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def teacher_forced_top1(url: str, prompt: list[int], ref: list[int]) -> list[int]:
    """The server's top-1 token at each of ``ref``'s positions, given the prompt and ref's prefix
    (teacher forcing: one divergence does not decide the rest, unlike a greedy prefix comparison)."""
    body = {
        "input_ids": prompt + ref[:-1],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        # SGLang gives no prediction for the first position of the logprob range: start one earlier
        "logprob_start_len": len(prompt) - 1,
        "top_logprobs_num": 1,
    }
    r = requests.post(f"{url}/generate", json=body, timeout=900)
    r.raise_for_status()
    m = r.json()["meta_info"]
    inputs = m["input_top_logprobs"][1:]  # the predictions of ref[0 .. n-2]
    assert len(inputs) == len(ref) - 1, (len(inputs), len(ref))
    return [int(e[0][1]) for e in inputs] + [int(m["output_top_logprobs"][0][0][1])]
