"""What benchmarks and tests send to a server: timed requests and chat turns, synthetic token
streams, metric readers, and the facts of the served model. The harness (results files,
environment, command line) is :mod:`benchmarks.harness`."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import requests

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


_KERNEL_BUILD_S: float | None = None


def kernel_build_seconds() -> float | None:
    """What :func:`prebuild_kernels` took in this process (None: not run, so a server's start-up
    may have included the build)."""
    return _KERNEL_BUILD_S


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


def teacher_forced_steps(url: str, prompt: list[int], ref: list[int], like: list[dict] | None = None) -> list[dict]:
    """The server's next-token logprobs after ``prompt + ref[:i]`` for every position i of ``ref``, each
    from its own request over the cached prefix: a few new rows (at most a page), so the decode-step
    path computes them (short extends take the gemv linears, where ``--loopkv-gguf-activations``
    acts), where :func:`teacher_forced_top1`'s one long extend takes the prefill path. Per position
    ``{"top": {token: logprob} (top 20), "chosen": logprobs of like[i]["top"]'s tokens}``."""
    from benchmarks.restore import first_token_logprobs

    return [
        first_token_logprobs(url, prompt + ref[:i], list(like[i]["top"]) if like else None) for i in range(len(ref))
    ]


def metrics(url: str) -> dict[str, float]:
    """The server's ``loopkv_*`` Prometheus samples, labels summed away per full sample name."""
    out: dict[str, float] = {}
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("loopkv_") and not line.startswith("#"):
            key, val = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(val)
    return out


def tier_bytes(url: str) -> dict[str, float]:
    """Bytes held per tier (``loopkv_tier_bytes``); empty when the server has no metrics."""
    out: dict[str, float] = {}
    try:
        for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("loopkv_tier_bytes{"):
                tier = line.split('tier="', 1)[1].split('"', 1)[0]
                out[tier] = float(line.rsplit(" ", 1)[1])
    except requests.RequestException:
        pass
    return out


def default_model_name() -> str:
    from sgl_loopkv.models import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def chat_turn(url: str, messages: list[dict], max_tokens: int, kind: str) -> dict:
    """Stream one greedy chat completion; TTFT = first chunk carrying text."""
    body = {
        "model": "default" if kind == "sglang" else default_model_name(),  # "default": whatever model is served
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "sglang":
        body["return_cached_tokens_details"] = True
    else:  # llama-cpp-python's server defaults to repeat_penalty 1.1 and top_k 40: plain greedy instead
        body.update(repeat_penalty=1.0, top_k=1, top_p=1.0, min_p=0.0, seed=0)
    t0 = time.perf_counter()
    ttft, text, chunks, usage, details = None, "", 0, None, None
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[6:])
            usage = msg.get("usage") or usage
            details = (msg.get("sglext") or {}).get("cached_tokens_details") or details
            for ch in msg.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text += piece
                    chunks += 1
    total = time.perf_counter() - t0
    n_out = (usage or {}).get("completion_tokens") or chunks
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    decode_s = total - (ttft or total)
    return {
        "ttft_s": ttft if ttft is not None else total,
        "total_s": total,
        "completion_tokens": n_out,
        "tpot_s": decode_s / (n_out - 1) if n_out > 1 else None,
        "cached_tokens": cached,
        "cached_details": details,
        "answer": text,
    }


def drop_page_cache(root: Path) -> None:
    """Evict a disk tier's segment files from the page cache: the next read comes from the device.
    Dirty pages are written out first, the whole system's (``sync``): a file written a moment ago (a
    filler turn's) is not evicted while dirty, only its write-back started, which then competed with
    the timed read that follows; the limit's read bandwidth is measured with no write beside it."""
    os.sync()
    for f in root.rglob("seg_*.kv"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
