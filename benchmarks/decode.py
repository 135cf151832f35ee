"""Decode benchmark: per-token decode latency of sgl-loopkv next to stock SGLang (same dtype),
float32 vs bfloat16, HF transformers ``generate()`` and llama.cpp's server, in one run on this
machine; the decode slowdown under memory pressure (small pool, disk tier, resumed
conversations); the physical limit (bytes read per token / measured memory bandwidth); and bf16's
fidelity vs float32 on SmolLM2.

Grid (``--contexts`` x ``--batch-sizes``): the ``bs`` requests of a batch share one synthetic
context except its last ``SUFFIX`` tokens, each request its own (``--distinct-contexts``: every
request a whole context of its own; on 2 cores stock SGLang prefills 8K tokens at ~40 tokens/s, so
eight distinct 8K contexts alone take half an hour per system). The shared part sits once in the
pool and every request's decode still reads all of its L keys and values, so a batch reads the
same bytes from one place: both systems get that same help from the CPU caches. Per server,
every context is prefilled once, untimed (``max_new_tokens=1``); then ``bs`` requests are sent at
once and stream ``--gen`` greedy tokens (``ignore_eos``): their prefix is in the radix cache, so
what is timed is decode. Per-token latency = inter-arrival time of streamed chunks (first chunk excluded; a chunk of k tokens counts
as k intervals of gap/k), taken only while every request of the batch is decoding; median and p90
over all tokens of ``--repeats`` batches; aggregate tokens/s over the same window. Every SGLang
server gets the same ``--max-total-tokens`` (all contexts of the largest batch at once + margin),
and a timed request whose prefix was not cached is flagged. HF ``generate()`` and llama.cpp run
bs 1 only (llama-cpp-python's server serves one request at a time); their prefill is in the first
token, which is excluded. llama.cpp reads the GGUF's Q4_1 weights (~0.6 bytes/parameter, about a
quarter of bf16's bytes), the others the dequantised weights in the served dtype.

Limit row: per decode step a system must read every weight once plus the attended KV of each
request: ``(weight bytes + bs x KV bytes/token x (context + gen/2)) / bandwidth`` per token, with
weight bytes = parameters (from the model's config.json, tied embeddings once) x dtype bytes and
bandwidth = median of ``torch.sum`` passes over a 1 GiB float32 tensor (all cores), measured at the
start and end of this run.

Pressure scenario (issue 13): ``--max-total-tokens 4096 --loopkv-disk-dir <tmp> --loopkv-host-bytes
100000000``, six multi-turn conversations (~880 new tokens a turn, histories up to ~3.5K) over the
OpenAI chat API with streaming, played interleaved (round robin, one request at a time) and then,
on a fresh server, concurrently (every conversation its own client); sgl-loopkv vs stock in the
headline dtype; then one 650-token prompt on the interleaved server ("after" TPOT).

bf16 fidelity (on the grid's loopkv servers): first-token KL(fp32 || bf16) over fp32's top-20 plus
the tail, and teacher-forced top-1 agreement of bf16 on fp32's 128 greedy tokens, at 2K/4K; and the
multi-turn benchmark's score per question position (quick suite, dense sgl-loopkv in each dtype).

On a CPU without native bf16 (no ``avx512_bf16`` / ``amx_bf16`` flag) torch's bf16 matmuls convert
to fp32 on the fly: a one-row decode step (memory-bound) still gains from half the bytes, but
prefill and larger batches (compute-bound) are several times slower. Then the bf16 rows shrink to bs 1 at one context (4K) unless ``--force-bf16``; the prefill
table shows what bf16 costs there. The headline dtype (pressure scenario, the summary's TPOT
ratio) is the launcher's default, float32 (bf16 is opt-in: ``platform.default_cpu_dtype``).

GGUF system (issue 53): ``loopkv-gguf`` serves the default model's GGUF file itself (``--model-path``),
float32 activations over a bfloat16 KV pool; its limit row reads the file's bytes once a step, its
fidelity is scored against loopkv-fp32 at the contexts from 2K up, ``--fid-contexts`` contexts per length
(default 3: the grid's and two of their own, each 128 teacher-forced positions, pooled per length), and :mod:`benchmarks.decode_gguf` adds the step breakdown
at the context nearest 4K and each server's memory after warm-up. The summary's ``gguf_*`` keys and the
ratios beside them are the issue's targets (llama.cpp's prefill = its first token on a cold prompt).

    python -m benchmarks.decode --systems loopkv-fp32 stock-fp32 loopkv-gguf llamacpp \
        --contexts 2048 4096 8000 --batch-sizes 1 8 --gen 32 --parts grid fidelity --out decode_gguf_run

    python -m benchmarks.decode                    # full run (~65 min on 2 cores with native bf16)
    python -m benchmarks.decode --quick            # contexts 512/2048, bs 1/4, fewer tokens
    python -m benchmarks.decode --quick --systems loopkv-fp32 --parts grid
    python -m benchmarks.decode --add-multiturn    # only the multi-turn scores, into the existing decode.json
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from tqdm import tqdm

from benchmarks import common
from benchmarks import conversations as conv
from benchmarks.common import synthetic_ids, teacher_forced_steps, teacher_forced_top1
from benchmarks.harness import cli
from benchmarks.harness.env import cpu_flags, environment, finish
from benchmarks.harness.plot import figure
from benchmarks.harness.results import RESULTS, load, md_table
from benchmarks.harness.stats import percentile, ratio
from sgl_loopkv import platform
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import DEFAULT_MODEL_NAME, ensure_default_model
from sgl_loopkv.server.process import ServerProcess

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "gguf": "gguf"}  # "gguf": the GGUF file's blocks (limit rows)
# name -> (kind, dtype, launcher flags). fp32 rows first: loopkv-fp32 is bf16's fidelity reference.
SYSTEMS = {
    "loopkv-fp32": ("sglang", "float32", ()),
    "stock-fp32": ("sglang", "float32", ("--loopkv-stock",)),
    # the GGUF file itself (--model-path x.gguf, prepended in run_sglang): blocks, launcher defaults (bf16 KV)
    "loopkv-gguf": ("sglang", "float32", ()),
    "loopkv-gguf-fp32kv": ("sglang", "float32", ("--kv-cache-dtype", "auto")),
    "loopkv-gguf-q8": ("sglang", "float32", ("--loopkv-gguf-activations", "q8")),
    "loopkv-gguf-torchops": ("sglang", "float32", ()),
    "loopkv-gguf-fp32prefill": ("sglang", "float32", ("--loopkv-prefill-dtype", "float32")),
    "loopkv-gguf-bf16prefill": ("sglang", "float32", ("--loopkv-prefill-dtype", "bfloat16")),
    "loopkv-gguf-torchattn": ("sglang", "float32", ()),
    "loopkv-gguf-splitsoftmax": ("sglang", "float32", ("--loopkv-prefill-softmax", "split")),
    "loopkv-gguf-bf16softmax": ("sglang", "float32", ("--loopkv-prefill-softmax", "bfloat16")),
    "loopkv-gguf-noplain": ("sglang", "float32", ()),
    "loopkv-bf16": ("sglang", "bfloat16", ()),
    "stock-bf16": ("sglang", "bfloat16", ("--loopkv-stock",)),
    "hf-fp32": ("hf", "float32", ()),
    "hf-bf16": ("hf", "bfloat16", ()),
    "llamacpp": ("llamacpp", "q4_1", ()),
    # the per-step bookkeeping of the tiered cache and of Krul's estimator, each measured by its absence/presence
    "loopkv-fp32-radix": (
        "sglang",
        "float32",
        ("--loopkv-stock", "--attention-backend", "loopkv", "--page-size", "16"),
    ),
    "loopkv-fp32-krul": ("sglang", "float32", ("--loopkv-share-layers", "minicache")),
    "loopkv-fp32-nodisk": ("sglang", "float32", ("--loopkv-tier-disk-dir", "none")),
    "loopkv-fp32-nolean": ("sglang", "float32", ()),
    "loopkv-fp32-exact": ("sglang", "float32", ()),
    "loopkv-bf16-exact": ("sglang", "bfloat16", ()),
}
#: Environment of a system's server beyond its flags (kernel and code-path switches are variables).
SYSTEM_ENV = {
    "loopkv-gguf-torchops": {"LOOPKV_NATIVE_LAYER_OPS": "0"},
    "loopkv-gguf-torchattn": {"LOOPKV_NATIVE_PREFILL_ATTENTION": "0"},
    "loopkv-gguf-noplain": {"LOOPKV_PLAIN_DECODE": "0"},
    "loopkv-fp32-nolean": {"LOOPKV_LEAN_FORWARD": "0"},
    "loopkv-fp32-exact": {"LOOPKV_EXACT_LINEAR": "1"},
    "loopkv-bf16-exact": {"LOOPKV_EXACT_LINEAR": "1"},
}
WHAT = {
    "loopkv": "sgl-loopkv launcher defaults (loopkv attention, tiered radix cache)",
    "stock": "stock SGLang 0.5.23 CPU configuration (`--loopkv-stock`: torch_native attention, stock radix cache)",
    "hf": "HF transformers `generate()` (greedy, bs 1, prefill in the excluded first token)",
    "llamacpp": "llama.cpp server (llama-cpp-python) on the same GGUF: reads Q4_1 weights, ~1/4 of bf16's bytes; bs 1",
    "loopkv-gguf": "sgl-loopkv launcher defaults serving the GGUF file itself (`--model-path <file>.gguf`: its Q4_1 "
    "and Q8_0 blocks through the block kernels, no float copy of a weight matrix), float32 activations, a bfloat16 "
    "KV pool (the GGUF path's default)",
    "loopkv-gguf-fp32kv": "`loopkv-gguf` with `--kv-cache-dtype auto`: a float32 KV pool (every number the "
    "dequantized float32 model's)",
    "loopkv-gguf-q8": "`loopkv-gguf` with `--loopkv-gguf-activations q8`: decode rows (up to 16) on int8 activations "
    "and integer block dots, as llama.cpp",
    "loopkv-gguf-torchops": "`loopkv-gguf` with SGLang's torch norms, rotary embedding and activation "
    "(`LOOPKV_NATIVE_LAYER_OPS=0`) instead of the compiled layer ops",
    # --loopkv-stock brings SGLang's radix cache and also drops the decode-step hooks (split/gemv
    # linears, lean forward): its ratio is not the tiered cache's cost alone (a radix-only switch is not built)
    "loopkv-gguf-fp32prefill": "`loopkv-gguf` with `--loopkv-prefill-dtype float32`: prefills in float32 (the "
    "default on a CPU without AMX-BF16, and in the `decode_gguf_prefill*` runs' era the default everywhere)",
    "loopkv-gguf-bf16prefill": "`loopkv-gguf` with `--loopkv-prefill-dtype bfloat16`: the prefill's linear layers on "
    "bfloat16 operands with float32 sums (oneDNN) and, from the split-bfloat16 kernel on, its attention with split "
    "queries (the default on AMX CPUs since `decode_gguf_attn`)",
    "loopkv-gguf-torchattn": "`loopkv-gguf` with a prefill's attention through torch's float32 flash kernel over the "
    "widened bfloat16 keys (`LOOPKV_NATIVE_PREFILL_ATTENTION=0`) instead of the split-bfloat16 kernel",
    "loopkv-gguf-splitsoftmax": "`loopkv-gguf` with `--loopkv-prefill-softmax split`: a bfloat16 prefill's softmax "
    "weights split in two bfloat16 parts (the default; in `decode_gguf_softmax` `loopkv-gguf` rounded them once)",
    "loopkv-gguf-bf16softmax": "`loopkv-gguf` with `--loopkv-prefill-softmax bfloat16`: a bfloat16 prefill's softmax "
    "weights rounded to bfloat16 once (half the P V products) instead of split",
    "loopkv-gguf-noplain": "`loopkv-gguf` with every decode layer through SGLang's `RadixAttention` and the "
    "backend's dispatch and `set_kv_buffer` (`LOOPKV_PLAIN_DECODE=0`) instead of the two-call plain decode layer",
    "loopkv-fp32-radix": "loopkv attention on SGLang's own radix cache (no tiers) in stock mode, so without the "
    "decode-step hooks (split/gemv linears, lean forward) too",
    "loopkv-fp32-krul": "sgl-loopkv defaults + `--loopkv-share-layers minicache` (Krul's estimator on every forward)",
    # the old flag name (still accepted) while benchmarks/results/decode.md, rendered from this text, says it
    "loopkv-fp32-nodisk": "sgl-loopkv defaults without the disk tier (`--loopkv-disk-dir none`): the disk writer's cost",
    "loopkv-fp32-nolean": "sgl-loopkv defaults with forwards through SGLang's layer modules (`LOOPKV_LEAN_FORWARD=0`)",
    "loopkv-fp32-exact": "sgl-loopkv defaults with F.linear's bits in every linear layer (`LOOPKV_EXACT_LINEAR=1`: "
    "the MKL split, no gemv_f32)",
    "loopkv-bf16-exact": "sgl-loopkv defaults in bfloat16 with F.linear's bits in every linear layer "
    "(`LOOPKV_EXACT_LINEAR=1`: oneDNN, no gemv_bf16)",
}
#: systems served from the default model's GGUF file instead of its converted float32 folder
GGUF_SYSTEMS = (
    "loopkv-gguf",
    "loopkv-gguf-fp32kv",
    "loopkv-gguf-q8",
    "loopkv-gguf-torchops",
    "loopkv-gguf-fp32prefill",
    "loopkv-gguf-bf16prefill",
    "loopkv-gguf-torchattn",
    "loopkv-gguf-splitsoftmax",
    "loopkv-gguf-bf16softmax",
    "loopkv-gguf-noplain",
)
#: systems scored against loopkv-fp32's tokens and logprobs (fidelity)
SCORED = ("loopkv-bf16", *GGUF_SYSTEMS)
# run at 4K with the smallest and largest batch only
BOOKKEEPING = ("loopkv-fp32-radix", "loopkv-fp32-krul", "loopkv-fp32-nodisk")


def what(name: str) -> str:
    return WHAT.get(name) or WHAT[name.split("-")[0]]


FID_CONTEXTS = (2048, 4096)
FID_GEN = 128
PRESSURE_POOL = 4096
PRESSURE_HOST_BYTES = 100_000_000
AFTER_PROMPT = 650
MT_DTYPES = ["float32", "bfloat16"]  # fidelity is a property of the dtype, measured on any CPU
MT_UNITS = 5 * 3 * len(MT_DTYPES)  # progress units: ~turns of the quick multi-turn suite per dtype (approximate)
SUFFIX = 64  # the requests of a batch differ in their last SUFFIX context tokens (unless --distinct-contexts)


# --- small helpers (tested in tests/unit/test_decode_bench.py) ------------------------------------------
def token_intervals(streams: list[list[tuple[float, int]]], steady: bool = True) -> tuple[list[float], float]:
    """Per-token latencies of concurrent streams, each a list of (arrival time, tokens so far).

    The first chunk (prefill + first token) is excluded; a chunk of k new tokens counts as k
    intervals of gap/k. With ``steady``, only gaps inside the window where every stream is past
    its first chunk and none has finished count (the batch decodes at its full size there); if
    that window holds fewer than 4 gaps, all gaps count. Returns (intervals, aggregate tokens/s
    over the window)."""
    streams = [s for s in streams if len(s) >= 2]
    if not streams:
        return [], float("nan")
    w0 = max(s[0][0] for s in streams) if steady else min(s[0][0] for s in streams)
    w1 = min(s[-1][0] for s in streams) if steady else max(s[-1][0] for s in streams)

    def collect(a: float, b: float) -> list[float]:
        out = []
        for s in streams:
            for (t0, n0), (t1, n1) in zip(s, s[1:]):
                if n1 > n0 and t0 >= a - 1e-9 and t1 <= b + 1e-9:
                    out += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
        return out

    got = collect(w0, w1) if w1 > w0 else []
    if len(got) < 4:
        w0, w1 = min(s[0][0] for s in streams), max(s[-1][0] for s in streams)
        got = collect(w0, w1)
    return got, (len(got) / (w1 - w0) if w1 > w0 else float("nan"))


def model_facts(model_dir: Path) -> dict:
    """Weights and KV geometry from the model's config.json (parameters counted on the meta
    device: a tied embedding is one parameter, counted once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "params": int(params),
        "layers": cfg.num_hidden_layers,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "max_positions": cfg.max_position_embeddings,
        "eos_token_id": cfg.eos_token_id,
    }


def limit_tpot_ms(
    facts: dict, dtype: str, context: int, bs: int, gen: int, bandwidth: float, weight_bytes: int | None = None
) -> float:
    """Lower bound on per-token latency: one decode step reads every weight once (``weight_bytes``,
    default the parameters in ``dtype``) and the attended KV (in ``dtype``) of each of the ``bs``
    requests (context + half the generated tokens on average)."""
    b = DTYPE_BYTES[dtype]
    kv_per_token = facts["layers"] * 2 * facts["kv_heads"] * facts["head_dim"] * b
    weights = facts["params"] * b if weight_bytes is None else weight_bytes
    step_bytes = weights + bs * kv_per_token * (context + gen / 2)
    return 1000 * step_bytes / bandwidth


def memory_bandwidth(passes: int = 5) -> list[float]:
    """Bytes/s of ``torch.sum`` over a 1 GiB float32 tensor, one value per pass (after a warm-up)."""
    x = torch.ones(1 << 28)
    x.sum()
    out = []
    for _ in range(passes):
        t0 = time.perf_counter()
        x.sum()
        out.append(x.numel() * 4 / (time.perf_counter() - t0))
    del x
    return out


def stats(intervals: list[float], tok_s: float, **extra) -> dict:
    return {
        "tpot_ms_median": 1000 * statistics.median(intervals) if intervals else None,
        "tpot_ms_p90": 1000 * percentile(intervals, 90) if intervals else None,
        "tok_s": tok_s,
        "n_tokens": len(intervals),
        **extra,
    }


# --- streaming clients -------------------------------------------------------------------------------
def stream_generate(url: str, ids: list[int], n: int, barrier: threading.Barrier | None = None) -> dict:
    """SGLang /generate, greedy, ignore_eos; arrivals = [(time, completion tokens so far)]."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    arrivals, last = [], None
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            last = json.loads(line[6:])
            arrivals.append((time.perf_counter(), int(last["meta_info"]["completion_tokens"])))
    return {
        "t0": t0,
        "arrivals": arrivals,
        "cached_tokens": last["meta_info"].get("cached_tokens", 0),
        "output_ids": last["output_ids"],
    }


def stream_chat(url: str, messages: list[dict], n: int) -> dict:
    """One greedy OpenAI chat completion (SGLang), ``n`` tokens (ignore_eos); per-turn TPOT."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    text, usage = "", None
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[6:])
            usage = msg.get("usage") or usage
            for ch in msg.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text += piece
    end = time.perf_counter()
    n_out = (usage or {}).get("completion_tokens") or 0
    return {
        "t0": t0,
        "end": end,
        "ttft_s": (first or end) - t0,
        "tpot_s": (last - first) / (n_out - 1) if first and n_out > 1 else None,
        "completion_tokens": n_out,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
        "answer": text,
    }


# --- grid: SGLang ------------------------------------------------------------------------------------
def run_sglang(
    name, dtype, flags, contexts, batch_sizes, ctx_ids, args, pool, bar, fid, on_cell=None, gguf: bool = False
) -> dict:
    """One server: per context, prefill then the timed batches; ``on_cell(url, cell)`` after each
    cell may add to its dict (benchmarks.decode_sparse reads /metrics there). The default model's GGUF
    file for the GGUF systems (or ``gguf``), else its float32 conversion (a plain start serves the file)."""
    from benchmarks.decode_gguf import tree_memory_mb
    from sgl_loopkv.models import default_model_gguf

    gguf = gguf or name in GGUF_SYSTEMS
    model = ("--model-path", str(default_model_gguf())) if gguf else ("--loopkv-weights", "float32")
    srv = ServerProcess(
        [*model, *flags, "--dtype", dtype, "--max-total-tokens", str(pool)],
        env=SYSTEM_ENV.get(name, {}),
        log_path=RESULTS / f"decode_{name}.log",
    )
    out: dict = {"startup_s": None, "cells": {}, "prefill_s": {}}
    try:
        srv.start()
        out["startup_s"] = srv.startup_s
        stream_generate(srv.url, ctx_ids[contexts[0]][0][:64], 16)  # warm-up
        out["memory_after_warmup"] = tree_memory_mb(srv.pids())
        for L in contexts:
            n_ctx = max(batch_sizes)  # this system's largest batch: each request its own context
            bar.set_postfix_str(f"{name} prefill {n_ctx} x {L}")
            for i in range(n_ctx):  # untimed: puts each context into the radix cache
                t0 = time.perf_counter()
                stream_generate(srv.url, ctx_ids[L][i], 1)
                out["prefill_s"].setdefault(str(L), []).append(time.perf_counter() - t0)
            bar.update()
            for bs in batch_sizes:
                bar.set_postfix_str(f"{name} {L} bs {bs}")
                ivals, toks, uncached = [], [], 0
                for _ in range(args.repeats):
                    barrier = threading.Barrier(bs)
                    with ThreadPoolExecutor(bs) as ex:
                        jobs = [
                            ex.submit(stream_generate, srv.url, ctx_ids[L][i], args.gen, barrier) for i in range(bs)
                        ]
                        runs = [j.result() for j in jobs]
                    iv, ts = token_intervals([r["arrivals"] for r in runs])
                    ivals += iv
                    toks.append(ts)
                    uncached += sum(r["cached_tokens"] < L - 16 for r in runs)
                out["cells"][f"{L}/{bs}"] = stats(ivals, statistics.median(toks), uncached_requests=uncached)
                if on_cell is not None:
                    on_cell(srv.url, out["cells"][f"{L}/{bs}"])
                if uncached:
                    print(f"[decode] {name} ctx {L} bs {bs}: {uncached} timed request(s) missed the prefix cache")
                bar.update()
            if fid is not None and L in fid["contexts"].get(name, ()):
                bar.set_postfix_str(f"{name} fidelity {L}")
                fidelity_step(srv.url, name, L, ctx_ids[L][0], fid)
                for i, ids in enumerate(fid.get("extra_ids", {}).get(L, ()), 1):  # more contexts of this length
                    fidelity_step(srv.url, name, f"{L}#{i}", ids, fid)
    finally:
        srv.stop()
    return out


def fidelity_step(url: str, name: str, L: int, ctx: list[int], fid: dict) -> None:
    """loopkv-fp32: the reference (greedy tokens, top-20 first-token logprobs, self-consistency of
    teacher forcing); a :data:`SCORED` server: scored on the reference, into ``scores[name]``."""
    from benchmarks.restore import first_token_logprobs, kl_topk, turn_ids

    prompt = ctx + turn_ids(fid["tok"])
    slot = fid["by_context"].setdefault(str(L), {"prompt_tokens": len(prompt)})
    if name == "loopkv-fp32":
        ref = stream_generate(url, prompt, FID_GEN)["output_ids"]
        slot["ref_ids"] = ref
        slot["ref_logprobs"] = first_token_logprobs(url, prompt, None)["top"]
        tf = teacher_forced_top1(url, prompt, ref)
        slot["fp32_self_agreement"] = sum(a == b for a, b in zip(tf, ref)) / len(ref)
        slot["ref_steps"] = [{"top": st["top"]} for st in teacher_forced_steps(url, prompt, ref)]
    elif "ref_ids" in slot:
        ref, ref_lp = slot["ref_ids"], slot["ref_logprobs"]
        lp = first_token_logprobs(url, prompt, list(ref_lp))
        tf = teacher_forced_top1(url, prompt, ref)
        own = stream_generate(url, prompt, FID_GEN)["output_ids"]
        sc = slot.setdefault("scores", {})[name] = {
            "first_token_kl": kl_topk(ref_lp, {**lp["top"], **lp["chosen"]}),
            "teacher_forced_agreement": sum(a == b for a, b in zip(tf, ref)) / len(ref),
            "greedy_identical_prefix": next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), len(ref)),
        }
        if "ref_steps" in slot:  # the same positions through the decode-step path (short extends)
            steps = teacher_forced_steps(url, prompt, ref, slot["ref_steps"])
            top1 = [max(st["top"], key=st["top"].get) for st in steps]
            kls = [kl_topk(r["top"], {**st["top"], **st["chosen"]}) for r, st in zip(slot["ref_steps"], steps)]
            sc["step_teacher_forced_agreement"] = sum(a == b for a, b in zip(top1, ref)) / len(ref)
            sc["step_kl_mean"] = statistics.fmean(kls)
            sc["step_kl_max"] = max(kls)


def scores(slot: dict, name: str) -> dict:
    """A fidelity slot's scores of system ``name`` (results before the GGUF system kept bf16's at the top)."""
    if "scores" in slot:
        return slot["scores"].get(name, {})
    return slot if name == "loopkv-bf16" else {}


# --- grid: HF and llama.cpp (bs 1) ----------------------------------------------------------------------
def run_hf(model_dir, dtype: str, contexts, ctx_ids, args, bar) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # first call: the prompt; then one call per generated token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def gen(ids, n):
        clock = Clock()
        with torch.no_grad():
            model.generate(
                torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock, pad_token_id=0
            )
        return clock.times[1:]  # generated tokens only

    gen(ctx_ids[contexts[0]][0][:64], 4)  # warm-up
    out = {"cells": {}}
    for L in contexts:
        bar.set_postfix_str(f"hf-{SHORT[dtype]} {L}")
        times = gen(ctx_ids[L][0], args.gen)
        ivals = [b - a for a, b in zip(times, times[1:])]
        out["cells"][f"{L}/1"] = stats(ivals, len(ivals) / (times[-1] - times[0]))
        bar.update()
    return out


def run_llamacpp(contexts, ctx_ids, tok, args, eos: int, bar) -> dict:
    from benchmarks.decode_gguf import tree_memory_mb
    from benchmarks.multiturn import LlamaCppServer, llamacpp_version

    srv = LlamaCppServer(n_ctx=max(contexts) + args.gen + 128, log_path=RESULTS / "decode_llamacpp.log")
    out = {"cells": {}, "version": llamacpp_version()}

    def complete(prompt: str, n: int) -> dict:
        body = {
            "model": DEFAULT_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "top_k": 1,
            "top_p": 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "seed": 0,
            "logit_bias": {str(eos): -100.0},  # ignore_eos
            "stream": True,
        }
        arrivals = []
        with requests.post(f"{srv.url}/v1/completions", json=body, stream=True, timeout=1800) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    arrivals.append((time.perf_counter(), len(arrivals) + 1))  # one token per chunk
        return {"arrivals": arrivals}

    try:
        srv.start()
        out["startup_s"] = srv.startup_s
        complete("Hello", 8)  # warm-up
        out["memory_after_warmup"] = tree_memory_mb([srv.proc.pid])
        for L in contexts:
            bar.set_postfix_str(f"llamacpp {L}")
            text = tok.decode(ctx_ids[L][0])
            ivals = []
            for i in range(args.repeats):  # its prompt cache serves the repeats' prefix
                t0 = time.perf_counter()
                run = complete(text, args.gen)
                if i == 0:  # a cold prompt (each context its own text): the first token is the whole prefill
                    out.setdefault("prefill_s", {})[str(L)] = [run["arrivals"][0][0] - t0]
                iv, _ = token_intervals([run["arrivals"]])
                ivals += iv
            out["cells"][f"{L}/1"] = stats(ivals, 1 / statistics.median(ivals) if ivals else float("nan"))
            bar.update()
    finally:
        srv.stop()
    return out


# --- pressure scenario ------------------------------------------------------------------------------
def pressure_convs(tok, n_convs: int, n_turns: int, per_turn: int) -> list[conv.Conversation]:
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    tasks = [conv.TASKS[i % len(conv.TASKS)] for i in range(n_convs)]
    return [conv.generate(t, 100 + i, n_turns, per_turn * n_turns, count) for i, t in enumerate(tasks)]


def run_pressure(name, dtype, flags, convs, mode: str, args, tok, bar) -> dict:
    disk = Path(tempfile.mkdtemp(prefix="loopkv-decode-pressure-"))
    srv = ServerProcess(
        [
            *flags,
            "--loopkv-weights",
            "float32",  # the default model's float32 conversion (a plain start serves the GGUF file)
            "--dtype",
            dtype,
            "--max-total-tokens",
            str(PRESSURE_POOL),
            "--loopkv-tier-disk-dir",
            str(disk),
            "--loopkv-tier-host-bytes",
            str(PRESSURE_HOST_BYTES),
        ],  # fmt: skip
        log_path=RESULTS / f"decode_pressure_{name}_{mode}.log",
    )
    turns: list[dict] = []
    lock = threading.Lock()

    def play(c, t):
        r = stream_chat(srv.url, c.messages(t), args.pressure_gen)
        r.update(conv=c.id, turn=t)
        with lock:
            turns.append(r)
            bar.update()

    try:
        srv.start()
        stream_generate(srv.url, synthetic_ids(tok, 64, seed=5), 16)  # warm-up
        bar.set_postfix_str(f"pressure {name} {mode}")
        t0 = time.perf_counter()
        n_turns = max(len(c.turns) for c in convs)
        if mode == "interleaved":  # round robin: each return finds its history evicted
            for t in range(n_turns):
                for c in convs:
                    if t < len(c.turns):
                        play(c, t)
        else:  # every conversation its own client, its turns back to back
            with ThreadPoolExecutor(len(convs)) as ex:
                list(ex.map(lambda c: [play(c, t) for t in range(len(c.turns))], convs))
        wall = time.perf_counter() - t0
        after = None
        if mode == "interleaved":  # does decode stay slow after the resumes? (issue 13)
            r = stream_generate(srv.url, synthetic_ids(tok, AFTER_PROMPT, seed=650), args.gen)
            iv, _ = token_intervals([r["arrivals"]])
            after = 1000 * statistics.median(iv) if iv else None
    finally:
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)
    tpots = [x["tpot_s"] for x in turns if x["tpot_s"]]
    return {
        "wall_s": wall,
        "turns_per_min": 60 * len(turns) / wall,
        "tpot_ms_median": 1000 * statistics.median(tpots) if tpots else None,
        "tpot_ms_p90": 1000 * percentile(tpots, 90) if tpots else None,
        "ttft_s_median": statistics.median(x["ttft_s"] for x in turns),
        "after_tpot_ms": after,
        "turns": sorted(turns, key=lambda x: (x["conv"], x["turn"])),
    }


# --- multi-turn score per question position, fp32 vs bf16 ------------------------------------------------
def shared_context_ids(tok, contexts, n_ctx: int) -> dict[int, list[list[int]]]:
    """Per context length, ``n_ctx`` requests sharing one context except their last SUFFIX tokens."""
    return {
        L: [synthetic_ids(tok, L, seed=1000 * L)]
        + [synthetic_ids(tok, L, seed=1000 * L)[: L - SUFFIX] + synthetic_ids(tok, SUFFIX, seed=1000 * L + i)
           for i in range(1, n_ctx)]
        for L in contexts
    }  # fmt: skip


def quick_multiturn(tok, per_task: int = 1):
    """benchmarks.multiturn --quick's conversations (``per_task`` per task: more turns per question
    position): (convs, history tokens per turn, device pool, host-tier bytes: a quarter of the fp32
    histories, as benchmarks.multiturn sizes it)."""
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    convs = conv.suite(conv.TASKS, per_task, [1024, 2048, 3072], (2, 3), 0, count)
    hist = {
        c.id: [count(tok.apply_chat_template(c.messages(t), tokenize=False, add_generation_prompt=True))
               for t in range(len(c.turns))]
        for c in convs
    }  # fmt: skip
    pool = (max(max(h) for h in hist.values()) + 64 + 15) // 16 * 16 + 256
    total = sum(hist[c.id][-1] + count(c.turns[-1].gold_reply) for c in convs)
    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    host_bytes = int(0.25 * total * common.model_facts(model_dir).kv_bytes_per_token(4))
    return convs, hist, pool, host_bytes


def run_multiturn_dtypes(tok, dtypes: list[str], bar) -> dict:
    from benchmarks import multiturn as mt

    convs, hist, pool, host_bytes = quick_multiturn(tok)
    out = {}
    for dt in dtypes:
        s = mt.System(f"decode_dense_{SHORT[dt]}", ("--dtype", dt), f"dense sgl-loopkv, {dt}")
        res = mt.run_system(s, convs, hist, pool, host_bytes, bar)
        rows = res["turns"]
        score = {p: mt.mean(x["score"] for x in rows if x["position"] == p) for p in conv.POSITIONS}
        score["all"] = mt.mean(x["score"] for x in rows)
        out[dt] = {"score": score, "answers": [x["answer"] for x in rows], "n_turns": len(rows)}
    return out


# --- report ---------------------------------------------------------------------------------------
def cell(res: dict, name: str, L: int, bs: int) -> dict | None:
    return (res.get(name) or {}).get("cells", {}).get(f"{L}/{bs}")


def tpot(res, name, L, bs):
    c = cell(res, name, L, bs)
    return c["tpot_ms_median"] if c else None


def summarize(p: dict) -> dict:
    res, cfg, hd = p["grid"], p["config"], p["config"]["headline_dtype"]
    ratios = {}
    for dt in ("float32", "bfloat16"):
        for L in cfg["contexts"]:
            for bs in cfg["batch_sizes"]:
                a, b = tpot(res, f"stock-{SHORT[dt]}", L, bs), tpot(res, f"loopkv-{SHORT[dt]}", L, bs)
                if a and b:
                    ratios[f"{SHORT[dt]}/{L}/{bs}"] = a / b
    fp32_4k, bf16_4k = tpot(res, "loopkv-fp32", 4096, 1), tpot(res, "loopkv-bf16", 4096, 1)
    default = [v for k, v in ratios.items() if k.startswith(SHORT[hd] + "/")]

    def step_cost(num: str, den: str) -> dict:  # TPOT num / den per cell both ran (> 1: num is slower)
        out = {}
        for L in cfg["contexts"]:
            for bs in cfg["batch_sizes"]:
                a, b = tpot(res, num, L, bs), tpot(res, den, L, bs)
                if a and b:
                    out[f"{L}/{bs}"] = a / b
        return out

    pr = p.get("pressure") or {}
    lk, st = f"loopkv-{SHORT[hd]}", f"stock-{SHORT[hd]}"

    def pratio(mode, key, inverse=False):
        try:
            a, b = pr[lk][mode][key], pr[st][mode][key]
            return (b / a) if inverse else (a / b)
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    fid = (p.get("fidelity") or {}).get("by_context", {})
    bf = {L: scores(v, "loopkv-bf16") for L, v in fid.items()}
    tfs = [v["teacher_forced_agreement"] for v in bf.values() if "teacher_forced_agreement" in v]
    kls = {L: v["first_token_kl"] for L, v in bf.items() if "first_token_kl" in v}
    mtd = p.get("multiturn_dtypes") or {}
    mt_ratio = None
    if "float32" in mtd and "bfloat16" in mtd:
        f, b = mtd["float32"]["score"], mtd["bfloat16"]["score"]
        mt_ratio = {k: (b[k] / f[k] if f[k] else None) for k in f}
    # interleaved turns run one at a time, so a turn's wall = TTFT + decode adds up: what loopkv's
    # turns per minute would be with its own TTFTs (resume + new tokens) and stock's decode times
    if_decode_equal = None
    try:
        lt = {(x["conv"], x["turn"]): x for x in pr[lk]["interleaved"]["turns"]}
        stt = pr[st]["interleaved"]["turns"]
        walls = sum(x["end"] - x["t0"] for x in stt)
        hyp = sum(lt[(x["conv"], x["turn"])]["ttft_s"] + (x["end"] - x["t0"] - x["ttft_s"]) for x in stt)
        if_decode_equal = walls / hyp
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    identical = {}
    for mode in ("interleaved", "concurrent"):
        try:
            a = {(x["conv"], x["turn"]): x["answer"] for x in pr[lk][mode]["turns"]}
            b = {(x["conv"], x["turn"]): x["answer"] for x in pr[st][mode]["turns"]}
            identical[mode] = sum(a[k] == b.get(k) for k in a) / len(a)
        except KeyError:
            pass
    return {
        "headline_dtype": hd,
        "native_bf16": p["env"]["cpu_flags"]["native_bf16"],
        # the acceptance figure: the launcher's default dtype; the other dtype's cells are in the dict
        "tpot_ratio_stock_over_loopkv_min": min(default) if default else None,
        "tpot_ratio_stock_over_loopkv_min_all_dtypes": min(ratios.values()) if ratios else None,
        "tpot_ratio_stock_over_loopkv": ratios,
        "pressure_turns_per_min_ratio": pratio("concurrent", "turns_per_min"),
        "pressure_turns_per_min_ratio_interleaved": pratio("interleaved", "turns_per_min"),
        "pressure_interleaved_ratio_if_decode_equal": if_decode_equal,
        "pressure_ttft_ratio_stock_over_loopkv": {
            m: pratio(m, "ttft_s_median", inverse=True) for m in ("interleaved", "concurrent")
        },
        "pressure_tpot_ratio_stock_over_loopkv": {
            m: pratio(m, "tpot_ms_median", inverse=True) for m in ("interleaved", "concurrent")
        },
        "pressure_answers_identical_fraction": identical,
        "bf16_speedup_4k": fp32_4k / bf16_4k if fp32_4k and bf16_4k else None,
        "bf16_teacher_forced_agreement": min(tfs) if tfs else None,
        "bf16_first_token_kl": kls,
        "bf16_first_token_kl_max": max(kls.values()) if kls else None,
        "bf16_multiturn_score_ratio": mt_ratio,
        # per-step bookkeeping, each against the same server without it (issue 13: "measure each")
        "tiered_cache_tpot_ratio": step_cost("loopkv-fp32", "loopkv-fp32-radix"),
        "krul_estimator_tpot_ratio": step_cost("loopkv-fp32-krul", "loopkv-fp32"),
        "disk_tier_tpot_ratio": step_cost("loopkv-fp32", "loopkv-fp32-nodisk"),
        "llamacpp_tpot_ms_4k": tpot(res, "llamacpp", 4096, 1),
        "hf_tpot_ms_4k": tpot(res, f"hf-{SHORT[hd]}", 4096, 1),
        "stock_tpot_ms_4k": tpot(res, st, 4096, 1),
        "loopkv_tpot_ms_4k": tpot(res, lk, 4096, 1),
        "limit_tpot_ms_4k": p["limit"]["tpot_ms"][hd].get("4096/1"),
        "bandwidth_gb_s": p["limit"]["bandwidth_bytes_s"] / 1e9,
        **gguf_summary(p),
    }


def near(contexts: list[int], target: int) -> int:
    return min(contexts, key=lambda L: abs(L - target))


def gguf_fidelity(fid: dict, name: str) -> tuple[dict, dict]:
    """Per context length, the worse of a GGUF system's two measurements: teacher-forced agreement (the
    prefill path's one long extend and the decode-step path's short extends, each pooled over the
    length's contexts: keys ``L`` and ``L#i``) and KL (the largest first-token and decode-step KL)."""
    tf_by, kl_by = defaultdict(lambda: defaultdict(list)), defaultdict(list)
    for key, v in fid.items():
        sc, L = scores(v, name), str(key).split("#")[0]
        for k in ("teacher_forced_agreement", "step_teacher_forced_agreement"):
            if k in sc:
                tf_by[L][k].append(sc[k])
        kl_by[L] += [sc[k] for k in ("first_token_kl", "step_kl_max") if k in sc]
    tfs = {L: min(statistics.fmean(xs) for xs in by.values()) for L, by in tf_by.items() if by}
    kls = {L: max(xs) for L, xs in kl_by.items() if xs}
    return tfs, kls


def gguf_summary(p: dict) -> dict:
    """Issue 53's keys: the GGUF system against llama.cpp, float32 and its own limit (empty without it)."""
    res, cfg = p["grid"], p["config"]
    if "loopkv-gguf" not in res:
        return {}
    c4, c8 = near(cfg["contexts"], 4096), near(cfg["contexts"], 8192)
    top = max(cfg["batch_sizes"])

    def fill_ms(name, L):
        v = (res.get(name) or {}).get("prefill_s", {}).get(str(L))
        return 1000 * v[0] if v else None

    def tok_s(name, L, bs):
        c = cell(res, name, L, bs)
        return c["tok_s"] if c else None

    def mem(name, key="rss_mb"):
        return ((res.get(name) or {}).get("memory_after_warmup") or {}).get(key)

    fid = (p.get("fidelity") or {}).get("by_context", {})
    tfs, kls = gguf_fidelity(fid, "loopkv-gguf")
    out = {
        "gguf_tpot_ms_4k": tpot(res, "loopkv-gguf", c4, 1),
        "gguf_tpot_ms_8k": tpot(res, "loopkv-gguf", c8, 1),
        "llamacpp_tpot_ms_8k": tpot(res, "llamacpp", c8, 1),
        "gguf_limit_tpot_ms_4k": p["limit"]["tpot_ms"].get("gguf", {}).get(f"{c4}/1"),
        "gguf_step_breakdown_ms_4k": {
            k: (p.get("gguf_step_breakdown") or {}).get(f"{k}_ms")
            for k in ("weights", "attention", "other", "layers_other", "framework")
        },
        f"gguf_tokens_per_s_bs{top}_4k": tok_s("loopkv-gguf", c4, top),
        f"fp32_tokens_per_s_bs{top}_4k": tok_s("loopkv-fp32", c4, top),
        "gguf_prefill_ms_4k": fill_ms("loopkv-gguf", c4),
        "fp32_prefill_ms_4k": fill_ms("loopkv-fp32", c4),
        "llamacpp_prefill_ms_4k": fill_ms("llamacpp", c4),
        "gguf_rss_mb": mem("loopkv-gguf"),
        "fp32_rss_mb": mem("loopkv-fp32"),
        # PSS: pages shared by the server's processes (torch's libraries, mapped by each) counted once
        "gguf_pss_mb": mem("loopkv-gguf", "pss_mb"),
        "llamacpp_pss_mb": mem("llamacpp", "pss_mb"),
        "gguf_teacher_forced_agreement": tfs,
        "gguf_teacher_forced_agreement_min": min(tfs.values()) if tfs else None,
        "gguf_kl": kls,
        "gguf_kl_max": max(kls.values()) if kls else None,
    }
    variants = {}
    for n in GGUF_SYSTEMS:
        if n in res:
            vt, vk = gguf_fidelity(fid, n)
            variants[n] = {
                "tpot_ms_4k": tpot(res, n, c4, 1),
                "tpot_ms_8k": tpot(res, n, c8, 1),
                f"tokens_per_s_bs{top}_4k": tok_s(n, c4, top),
                "prefill_ms_4k": fill_ms(n, c4),
                "fp32_over_prefill_4k": ratio(fill_ms("loopkv-fp32", c4), fill_ms(n, c4)),  # >= 1.5
                "teacher_forced_agreement_min": min(vt.values()) if vt else None,
                "kl_max": max(vk.values()) if vk else None,
            }
    out["gguf_systems"] = variants
    # the targets' ratios, each read so that > 1 (or <= the bar) is where the issue wants it
    out |= {
        "gguf_over_llamacpp_tpot_4k": ratio(out["gguf_tpot_ms_4k"], tpot(res, "llamacpp", c4, 1)),  # <= 0.75
        "gguf_over_llamacpp_tpot_8k": ratio(out["gguf_tpot_ms_8k"], out["llamacpp_tpot_ms_8k"]),  # <= 0.75
        "gguf_over_limit_tpot_4k": ratio(out["gguf_tpot_ms_4k"], out["gguf_limit_tpot_ms_4k"]),  # <= 2
        f"gguf_over_fp32_tokens_per_s_bs{top}_4k": ratio(
            out[f"gguf_tokens_per_s_bs{top}_4k"], out[f"fp32_tokens_per_s_bs{top}_4k"]
        ),  # >= 2
        "fp32_over_gguf_prefill_4k": ratio(out["fp32_prefill_ms_4k"], out["gguf_prefill_ms_4k"]),  # >= 1.5
        "llamacpp_over_gguf_prefill_4k": ratio(out["llamacpp_prefill_ms_4k"], out["gguf_prefill_ms_4k"]),  # >= 1
        "gguf_over_llamacpp_pss": ratio(out["gguf_pss_mb"], out["llamacpp_pss_mb"]),  # no target: docs/models.md
        "gguf_over_fp32_rss": ratio(out["gguf_rss_mb"], out["fp32_rss_mb"]),  # < 1
    }
    return out


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def contexts_how(cfg: dict) -> str:
    if "--distinct-contexts" in cfg["argv"]:
        return "each request its own context"
    return f"the requests of a batch share their context except its last {SUFFIX} tokens"


def report_md(p: dict) -> str:
    cfg, env, sm, res, lim = p["config"], p["env"], p["summary"], p["grid"], p["limit"]
    hd = cfg["headline_dtype"]
    head = (
        f"# {cfg.get('name', 'decode')} ({env['when']}; `python -m benchmarks.decode {' '.join(cfg['argv'])}`; git {env['git']['commit'][:10]}"
        f"{' (dirty)' if env['git']['dirty_files'] else ''}; {env.get('cores') or env['cpu_count']} cores, torch {env['torch']}, CPU flags "
        f"{', '.join(k for k, v in env['cpu_flags'].items() if v) or 'none'}; load avg {env['loadavg_start']:.1f} -> "
        f"{env['loadavg_end']:.1f}; {env['wall_s'] / 60:.1f} min wall)\n\n"
        f"SmolLM2-135M-Instruct, greedy, {cfg['gen']} generated tokens per request (ignore_eos), "
        f"{contexts_how(cfg)}, prefix prefilled untimed; per-token latency = streamed inter-arrival time (first token excluded), "
        f"median (p90) in ms over {cfg['repeats']} batch(es). Every SGLang server: `--max-total-tokens {cfg['pool']}`. "
        f"Headline dtype: **{hd}**, the launcher's default (native bf16 on this CPU: {sm['native_bf16']}; bf16 is opt-in). Limit = (weights + attended KV) / "
        f"{sm['bandwidth_gb_s']:.1f} GB/s ({lim['how']}).\n\n"
    )
    names = [n for n in SYSTEMS if n in res]
    md = head
    for bs in cfg["batch_sizes"]:
        rows = []
        for n in names:
            cells = [cell(res, n, L, bs) for L in cfg["contexts"]]
            if any(cells):
                rows.append(
                    [n]
                    + [f"{fmt_ms(c['tpot_ms_median'])} ({fmt_ms(c['tpot_ms_p90'])})" if c else "-" for c in cells]
                    + [" / ".join(f"{c['tok_s']:.1f}" if c else "-" for c in cells)]
                )
        for dt in lim["tpot_ms"]:
            rows.append(
                [f"limit-{SHORT[dt]}"]
                + [fmt_ms(lim["tpot_ms"][dt][f"{L}/{bs}"]) for L in cfg["contexts"]]
                + [" / ".join(f"{bs * 1000 / lim['tpot_ms'][dt][f'{L}/{bs}']:.1f}" for L in cfg["contexts"])]
            )
        md += f"Batch size {bs} ({bs} concurrent requests): TPOT ms, median (p90); aggregate tokens/s per context\n\n"
        md += md_table(["system", *(f"ctx {L}" for L in cfg["contexts"]), "tok/s"], rows) + "\n"

    def fills(v: list[float] | None) -> str:  # first fill = the whole context; the others extend its cached prefix
        if not v:
            return "-"
        rest = f" ({fmt_ms(1000 * statistics.median(v[1:]))})" if len(v) > 1 else ""
        return fmt_ms(1000 * v[0]) + rest

    pre = [
        [n, *(fills(res[n]["prefill_s"].get(str(L))) for L in cfg["contexts"])]
        for n in names
        if res[n].get("prefill_s")
    ]
    if pre:
        shared = "--distinct-contexts" not in cfg["argv"]
        md += (
            "Prefill, the untimed fills before the decode cells (ms): the first request's whole context, one sample"
            + (
                f"; in parentheses the median of the other requests, which find all but their last {SUFFIX} tokens "
                "cached (an extend onto a cached history: what a returning turn costs)"
                if shared
                else "; in parentheses the median of the other requests' whole contexts"
            )
            + "\n\n"
            + md_table(["system", *(f"ctx {L}" for L in cfg["contexts"])], pre)
            + "\n"
        )
    if sm["tpot_ratio_stock_over_loopkv"]:
        md += (
            "TPOT stock / loopkv (same dtype; > 1: sgl-loopkv faster): "
            + ", ".join(f"{k} {v:.2f}" for k, v in sm["tpot_ratio_stock_over_loopkv"].items())
            + f"; min in the default dtype ({hd}) **{_f(sm['tpot_ratio_stock_over_loopkv_min'])}**, over both dtypes "
            f"{_f(sm.get('tpot_ratio_stock_over_loopkv_min_all_dtypes'))}.\n\n"
        )
    for key, what_ in (("tiered_cache_tpot_ratio", "tiered cache and decode-step hooks (loopkv-fp32 / loopkv-fp32-radix)"),
                       ("krul_estimator_tpot_ratio", "Krul's estimator (loopkv-fp32-krul / loopkv-fp32)"),
                       ("disk_tier_tpot_ratio", "disk tier's writer (loopkv-fp32 / loopkv-fp32-nodisk)")):  # fmt: skip
        if sm.get(key):
            md += (
                f"Per-step cost of the {what_}, TPOT ratio per ctx/bs: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sm[key].items())
                + ".\n\n"
            )
    pr = p.get("pressure")
    if pr:
        c = p["config"]["pressure"]
        rows = [
            [n, m, fmt_ms(r["tpot_ms_median"]), fmt_ms(r["tpot_ms_p90"]), r["ttft_s_median"], r["turns_per_min"],
             r["wall_s"], fmt_ms(r["after_tpot_ms"])]
            for n, modes in pr.items()
            for m, r in modes.items()
        ]  # fmt: skip
        md += (  # old flag names (still accepted), as the committed report renders them
            f"Pressure scenario: `--max-total-tokens {PRESSURE_POOL} --loopkv-disk-dir <tmp> --loopkv-host-bytes "
            f"{PRESSURE_HOST_BYTES}`, {c['convs']} conversations x {c['turns']} turns (~{c['mean_new_tokens_per_turn']} new tokens a "
            f"turn, prompts up to {c['max_prompt_tokens']} tokens), {c['gen']} tokens per answer, OpenAI chat API "
            f"streaming; interleaved = round robin one request at a time, concurrent = all conversations at once "
            f"(fresh server). TPOT per turn (decode time / (tokens - 1)), median and p90 over turns; after = TPOT of a "
            f"{AFTER_PROMPT}-token prompt right after the interleaved run.\n\n"
            + md_table(
                [
                    "system",
                    "mode",
                    "TPOT ms median",
                    "TPOT ms p90",
                    "TTFT s median",
                    "turns/min",
                    "wall s",
                    "after: TPOT ms",
                ],
                rows,
            )  # fmt: skip
            + f"\nturns/min loopkv / stock: concurrent {_f(sm['pressure_turns_per_min_ratio'])}, interleaved "
            f"{_f(sm['pressure_turns_per_min_ratio_interleaved'])}; TPOT stock / loopkv: "
            + ", ".join(f"{m} {_f(v)}" for m, v in sm["pressure_tpot_ratio_stock_over_loopkv"].items())
            + "; TTFT stock / loopkv: "
            + ", ".join(f"{m} {_f(v)}" for m, v in sm["pressure_ttft_ratio_stock_over_loopkv"].items())
            + "; interleaved turns/min ratio with stock's decode times (loopkv's TTFTs kept): "
            + _f(sm["pressure_interleaved_ratio_if_decode_equal"])
            + "; answers identical to stock: "
            + ", ".join(f"{m} {v:.2f}" for m, v in sm["pressure_answers_identical_fraction"].items())
            + ".\n\n"
        )
    fid = (p.get("fidelity") or {}).get("by_context")
    if fid:
        rows = [
            [n, L, v["prompt_tokens"], sc.get("first_token_kl", "-"), sc.get("teacher_forced_agreement", "-"),
             sc.get("step_teacher_forced_agreement", "-"), sc.get("step_kl_max", "-"),
             sc.get("greedy_identical_prefix", "-"), v.get("fp32_self_agreement", "-")]
            for n in SCORED
            for L, v in fid.items()
            if (sc := scores(v, n))
        ]  # fmt: skip
        md += (
            f"bf16 and GGUF vs fp32 (sgl-loopkv servers, prompt = context + a user turn; loopkv-fp32's {FID_GEN} greedy "
            "tokens and first-token top-20 logprobs are the reference):\n\n"
            + md_table(
                [
                    "system",
                    "context",
                    "prompt tokens",
                    "first-token KL",
                    "teacher-forced top-1 agreement",
                    "decode-step teacher-forced agreement",
                    "decode-step KL, max",
                    "identical greedy tokens before first divergence",
                    "fp32 teacher forcing on itself",
                ],
                rows,
            )  # fmt: skip
            + "\n"
        )
        if any("#" in str(L) for L in fid):
            md += (
                "Contexts `L#i` are further contexts of length L. The GGUF figures below pool a length's contexts: "
                "per length the mean agreement of each path over its contexts, the worse path's; KL the largest.\n\n"
            )
    md += gguf_md(p)
    mtd = p.get("multiturn_dtypes")
    if mtd:
        keys = [*conv.POSITIONS, "all"]
        rows = [[dt, *(v["score"][k] for k in keys)] for dt, v in mtd.items()]
        if sm["bf16_multiturn_score_ratio"]:
            rows.append(["bf16 / fp32", *(sm["bf16_multiturn_score_ratio"][k] or "-" for k in keys)])
        md += (
            "Multi-turn benchmark score per question position (quick suite, dense sgl-loopkv"
            + (
                f"; a later run, {mr['when']}, git {mr['git']['commit'][:10]}"
                if (mr := env.get("multiturn_run"))
                else ""
            )
            + "):\n\n"
            + md_table(["dtype", *(f"q@{k}" if k != "all" else "all" for k in keys)], rows)
            + "\n"
        )
    md += "".join(f"- `{n}`: {what(n)}, {SYSTEMS[n][1]}\n" for n in names)
    md += "".join(f"- `{n}` failed: {e}\n" for n, e in p.get("failed", {}).items())
    return md


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def gguf_md(p: dict) -> str:
    """The GGUF system's targets (issue 53) as measured, and its step breakdown."""
    sm = p["summary"]
    if "gguf_tpot_ms_4k" not in sm:
        return ""
    top = max(p["config"]["batch_sizes"])
    bd, b = p.get("gguf_step_breakdown") or {}, sm["gguf_step_breakdown_ms_4k"]
    rows = [
        ["TPOT 4K / llama.cpp's", fmt_ms(sm["gguf_tpot_ms_4k"]), fmt_ms(sm["llamacpp_tpot_ms_4k"]),
         _f(sm["gguf_over_llamacpp_tpot_4k"]), "<= 0.75"],
        ["TPOT 8K / llama.cpp's", fmt_ms(sm["gguf_tpot_ms_8k"]), fmt_ms(sm["llamacpp_tpot_ms_8k"]),
         _f(sm["gguf_over_llamacpp_tpot_8k"]), "<= 0.75"],
        ["TPOT 4K / its limit", fmt_ms(sm["gguf_tpot_ms_4k"]), fmt_ms(sm["gguf_limit_tpot_ms_4k"]),
         _f(sm["gguf_over_limit_tpot_4k"]), "<= 2"],
        [f"tokens/s, bs {top} at 4K / float32's", _f(sm[f"gguf_tokens_per_s_bs{top}_4k"]),
         _f(sm[f"fp32_tokens_per_s_bs{top}_4k"]), _f(sm[f"gguf_over_fp32_tokens_per_s_bs{top}_4k"]), ">= 2"],
        ["4K first fill ms: float32's / GGUF's", fmt_ms(sm["gguf_prefill_ms_4k"]), fmt_ms(sm["fp32_prefill_ms_4k"]),
         _f(sm["fp32_over_gguf_prefill_4k"]), ">= 1.5"],
        ["4K first fill ms: llama.cpp's / GGUF's", fmt_ms(sm["gguf_prefill_ms_4k"]),
         fmt_ms(sm["llamacpp_prefill_ms_4k"]), _f(sm["llamacpp_over_gguf_prefill_4k"]), ">= 1"],
        ["server RSS MB / float32's", fmt_ms(sm["gguf_rss_mb"]), fmt_ms(sm["fp32_rss_mb"]), _f(sm["gguf_over_fp32_rss"]),
         "< 1"],
        ["server PSS MB / llama.cpp's (its pool and processes: docs/models.md)", fmt_ms(sm.get("gguf_pss_mb")),
         fmt_ms(sm.get("llamacpp_pss_mb")), _f(sm.get("gguf_over_llamacpp_pss")), "-"],
        ["teacher-forced agreement with float32, min (prefill and decode-step paths)",
         _f(sm["gguf_teacher_forced_agreement_min"]), "-", "-", ">= 0.99"],
        ["KL vs float32, max (first token and decode steps)",
         f"{sm['gguf_kl_max']:.4f}" if sm["gguf_kl_max"] is not None else "-", "-", "-", "<= 0.01"],
    ]  # fmt: skip
    md = (
        "GGUF path (`loopkv-gguf`) against its targets (first fill = the first request's whole context, untimed cell "
        "of the grid; llama.cpp's = the time to its first streamed token of a cold prompt; RSS = the server's process "
        "tree after a warm-up request, summed):\n\n"
        + md_table(["figure", "loopkv-gguf", "other", "ratio", "target"], rows)
        + "\n"
    )
    variants = sm.get("gguf_systems") or {}
    if len(variants) > 1:
        vrows = [
            [n, fmt_ms(v["tpot_ms_4k"]), fmt_ms(v["tpot_ms_8k"]), _f(v[f"tokens_per_s_bs{top}_4k"]),
             fmt_ms(v.get("prefill_ms_4k")), _f(v["teacher_forced_agreement_min"]), f"{v['kl_max']:.4f}" if v["kl_max"] is not None else "-"]
            for n, v in variants.items()
        ]  # fmt: skip
        md += (
            "The GGUF systems side by side (one request's TPOT; fidelity as above, against loopkv-fp32):\n\n"
            + md_table(
                [
                    "system",
                    "TPOT 4K ms",
                    "TPOT 8K ms",
                    f"tokens/s bs {top} 4K",
                    "4K first fill ms",
                    "agreement min",
                    "KL max",
                ],
                vrows,
            )
            + "\n"
        )
    if bd.get("tpot_ms") is not None:
        alone = bd.get("kernels_alone") or {}
        md += (
            f"Where a GGUF decode step goes at {bd['context']} tokens, one request (ms): weights {fmt_ms(b['weights'])} "
            f"({bd['weight_bytes'] / 1e6:.0f} MB of blocks), attention {fmt_ms(b['attention'])}, everything else "
            f"{fmt_ms(b['other'])} (the layers' glue {fmt_ms(bd.get('layers_other_ms'))}, SGLang's step around the "
            f"forward {fmt_ms(bd.get('framework_ms'))}) of that server's step {fmt_ms(bd['tpot_ms'])}. How: {bd['how']} "
            f"The same kernels alone: weights {fmt_ms(alone.get('weights_ms'))}, attention "
            f"{fmt_ms(alone.get('attention_ms'))} ({alone.get('how', '')})\n\n"
        )
    return md


def plot(p: dict, path: Path) -> None:
    cfg = p["config"]
    if len(cfg["contexts"]) == 1:  # one context: TPOT against the batch size
        with figure(path, size=(6.5, 4.4)) as (fig, ax):
            _plot_batch(p, fig, ax)
        return
    more = [bs for bs in cfg["batch_sizes"] if bs > 1]
    panels = ([[1]] if 1 in cfg["batch_sizes"] else []) + ([more] if more else [])
    with figure(path, 1, len(panels), size=(6 * len(panels) + 0.5, 4.4), squeeze=False) as (fig, axes):
        _plot_context(p, fig, axes, panels, more)


def _colors() -> dict:
    return {n: f"C{i % 10}" for i, n in enumerate([*SYSTEMS, "limit-fp32", "limit-bf16", "limit-gguf"])}


def _plot_batch(p: dict, fig, ax) -> None:
    cfg, res, lim, colors = p["config"], p["grid"], p["limit"]["tpot_ms"], _colors()
    (L,), sizes = cfg["contexts"], cfg["batch_sizes"]
    for n in SYSTEMS:
        pts = [(bs, y) for bs in sizes if (y := tpot(res, n, L, bs))]
        if pts:  # an -exact system dashed in its base system's colour (the colour cycle has 10)
            base = n.removesuffix("-exact")
            ax.plot(*zip(*pts), "--s" if base != n else "-o", color=colors[base], label=n, alpha=0.85)
    for dt, t in lim.items():
        pts = [(bs, t[f"{L}/{bs}"]) for bs in sizes if f"{L}/{bs}" in t]
        ax.plot(*zip(*pts), "-", color=colors[f"limit-{SHORT[dt]}"], alpha=0.5, lw=1, label=f"limit {SHORT[dt]}")
    ax.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="TPOT ms (median)")
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xticks([], minor=True)
    ax.set_title(f"context {L} tokens")
    ax.legend(fontsize=7)
    fig.suptitle("Decode TPOT vs batch (SmolLM2-135M, CPU)")


def _plot_context(p: dict, fig, axes, panels, more) -> None:
    cfg, res, lim, colors = p["config"], p["grid"], p["limit"]["tpot_ms"], _colors()
    styles = {1: "-o", **{bs: s for bs, s in zip(more, ("-s", "--^", ":v", "-.D"))}}
    for ax, sizes in zip(axes[0], panels):
        for bs in sizes:
            for n in SYSTEMS:
                pts = [(L, tpot(res, n, L, bs)) for L in cfg["contexts"]]
                pts = [(x, y) for x, y in pts if y]
                if pts:
                    lab = n if len(sizes) == 1 else f"{n} bs {bs}"
                    ax.plot(*zip(*pts), styles[bs], color=colors[n], label=lab, alpha=0.85)
            for dt, t in lim.items():
                ax.plot(
                    cfg["contexts"],
                    [t[f"{L}/{bs}"] for L in cfg["contexts"]],
                    styles[bs],
                    color=colors[f"limit-{SHORT[dt]}"],
                    alpha=0.5,
                    lw=1,
                    label=f"limit {SHORT[dt]}" + (f" bs {bs}" if len(sizes) > 1 else ""),
                )
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="TPOT ms (median)")
        ax.set_xticks(cfg["contexts"], [str(L) for L in cfg["contexts"]])
        ax.set_xticks([], minor=True)  # the log axis' own minor labels overprint the contexts
        ax.set_title("bs 1" if sizes == [1] else "concurrent requests: " + ", ".join(f"bs {b}" for b in sizes))
        ax.legend(fontsize=7)
    fig.suptitle("Decode TPOT vs context (SmolLM2-135M, CPU)")


def add_multiturn(payload: dict) -> None:
    """Run the bf16-vs-fp32 multi-turn scores into an existing payload (a later run: its own env record)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_default_model(LoopKVConfig().resolved_cache_dir))
    env = environment() | {"argv": sys.argv[1:]}
    with tqdm(total=MT_UNITS, desc="decode multiturn") as bar:
        payload["multiturn_dtypes"] = run_multiturn_dtypes(tok, MT_DTYPES, bar)
    payload["env"]["multiturn_run"] = finish(env)


# --- main -------------------------------------------------------------------------------------------
def run(args, env: dict) -> dict:
    if args.add_multiturn:  # the grid's run keeps its env record; the multi-turn run gets its own
        payload = load(args.out)
        add_multiturn(payload)
        return payload
    q = args.quick
    contexts = sorted(args.contexts or ([512, 2048] if q else [512, 2048, 4096, 8000]))
    batch_sizes = sorted(args.batch_sizes or ([1, 4] if q else [1, 4, 8]))
    args.gen = args.gen or (32 if q else 64)
    args.pressure_gen = args.pressure_gen or (16 if q else 32)
    pc = {
        "convs": args.pressure_convs or (3 if q else 6),
        "turns": args.pressure_turns or (2 if q else 4),
        "per_turn": args.pressure_per_turn or (600 if q else 940),
        "gen": args.pressure_gen,
    }
    flags = cpu_flags()
    bf16_full = flags["native_bf16"] or args.force_bf16
    headline = platform.default_cpu_dtype()  # the launcher's default: what a user gets
    names = [n for n in SYSTEMS if n in args.systems] if args.systems else list(SYSTEMS)  # loopkv-fp32 first
    if not bf16_full and not args.systems:
        names = [n for n in names if n != "hf-bf16"]
    # bf16 without native support: bs 1 at the context nearest 4K only (emulated bf16 is ~5-10x slower)
    bf16_ctx = contexts if bf16_full else [min(contexts, key=lambda L: abs(L - 4096))]
    bf16_bs = batch_sizes if bf16_full else [1]
    ends = lambda xs: sorted({xs[0], xs[-1]})  # noqa: E731
    near_4k = min(contexts, key=lambda L: abs(L - 4096))

    def scope(n: str) -> tuple[list[int], list[int]]:
        """(contexts, batch sizes) system ``n`` runs."""
        if SYSTEMS[n][1] == "bfloat16":
            return bf16_ctx, bf16_bs
        return ([near_4k], ends(batch_sizes)) if n in BOOKKEEPING else (contexts, batch_sizes)

    if not bf16_full:
        print(
            f"[decode] no native bf16 on this CPU: bf16 rows only at ctx {bf16_ctx[0]}, bs {bf16_bs} (--force-bf16: all)"
        )

    from transformers import AutoTokenizer

    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    facts = model_facts(model_dir)
    assert max(contexts) + args.gen <= facts["max_positions"], "context + generated tokens past the model's positions"
    n_ctx = max(batch_sizes)
    if args.distinct_contexts:
        ctx_ids = {L: [synthetic_ids(tok, L, seed=1000 * L + i) for i in range(n_ctx)] for L in contexts}
    else:  # one context per length, each request its own last SUFFIX tokens (see the module docstring)
        ctx_ids = shared_context_ids(tok, contexts, n_ctx)
    page = 16
    pool = n_ctx * ((max(contexts) + args.gen + 2 * page) // page * page) + 4096

    want_llama = "llamacpp" in names and "grid" in args.parts
    if want_llama:
        from benchmarks.multiturn import LLAMACPP_VENV, install_llamacpp, llamacpp_version

        if llamacpp_version() is None:
            print("installing llama-cpp-python[server] into", LLAMACPP_VENV, "(compiles; several minutes)")
            install_llamacpp()

    bw = memory_bandwidth()

    fid_ctx = {
        "loopkv-bf16": [L for L in FID_CONTEXTS if L in contexts and (bf16_full or L in bf16_ctx)] or [bf16_ctx[-1]],
        **{n: [L for L in contexts if L >= 2048] or [max(contexts)] for n in GGUF_SYSTEMS},  # 2K/4K/8K
    }
    fid_ctx = {n: cs for n, cs in fid_ctx.items() if n in names}
    fid = None
    if "fidelity" in args.parts and "loopkv-fp32" in names and fid_ctx and "grid" in args.parts:
        fid_ctx["loopkv-fp32"] = sorted({L for cs in fid_ctx.values() for L in cs})
        # contexts scored per length: the grid's, then ones of their own (one near-tie flip in 128
        # positions moves a single context's agreement by 0.008; the bar is 0.99)
        extra = {
            L: [synthetic_ids(tok, L, seed=7000 + 100 * i + L) for i in range(1, args.fid_contexts)] for L in contexts
        }
        fid = {"contexts": fid_ctx, "by_context": {}, "tok": tok, "extra_ids": extra}
    convs = pressure_convs(tok, pc["convs"], pc["turns"], pc["per_turn"]) if "pressure" in args.parts else []

    # progress units: per SGLang system one per context prefill + one per cell; HF/llama.cpp one per context
    units = 0
    if "grid" in args.parts:
        for n in names:
            cs, bss = scope(n)
            units += len(cs) * (1 + len(bss)) if SYSTEMS[n][0] == "sglang" else len(cs)
    units += 4 * sum(len(c.turns) for c in convs)
    if "multiturn" in args.parts:
        units += MT_UNITS

    grid, failed, pressure, mtd = {}, {}, {}, None
    with tqdm(total=units, desc="decode") as bar:
        if "grid" in args.parts:
            for n in names:
                kind, dt, fl = SYSTEMS[n]
                cs, bss = scope(n)
                t_sys = time.monotonic()
                try:
                    if kind == "sglang":
                        f = fid if n in ("loopkv-fp32", *SCORED) else None
                        grid[n] = run_sglang(n, dt, fl, cs, bss, ctx_ids, args, pool, bar, f)
                    elif kind == "hf":
                        grid[n] = run_hf(model_dir, dt, cs, ctx_ids, args, bar)
                    else:
                        grid[n] = run_llamacpp(cs, ctx_ids, tok, args, facts["eos_token_id"], bar)
                    grid[n]["wall_s"] = time.monotonic() - t_sys  # start-up and untimed prefills included
                except Exception as e:  # one broken system must not cost the others' measurements
                    failed[n] = repr(e)
                    print(f"[decode] {n} failed: {e!r}")
        if convs:
            for base, fl in (("loopkv", ()), ("stock", ("--loopkv-stock",))):
                n = f"{base}-{SHORT[headline]}"
                for m in ("interleaved", "concurrent"):
                    try:
                        t_run = time.monotonic()
                        pressure.setdefault(n, {})[m] = run_pressure(n, headline, fl, convs, m, args, tok, bar)
                        pressure[n][m]["run_wall_s"] = time.monotonic() - t_run  # with server start-up
                    except Exception as e:
                        failed[f"pressure {n} {m}"] = repr(e)
                        print(f"[decode] pressure {n} {m} failed: {e!r}")
        if "multiturn" in args.parts:
            try:
                t_mt = time.monotonic()
                mtd = run_multiturn_dtypes(tok, MT_DTYPES, bar)
                env["multiturn_wall_s"] = time.monotonic() - t_mt
            except Exception as e:
                failed["multiturn"] = repr(e)
                print(f"[decode] multiturn failed: {e!r}")
    bw += memory_bandwidth()

    gguf_file = breakdown = None
    if any(n in grid for n in GGUF_SYSTEMS):
        from benchmarks.decode_gguf import file_weight_bytes, served_breakdown, step_breakdown
        from sgl_loopkv.models import default_model_gguf

        gguf_file = default_model_gguf()
        try:
            breakdown = served_breakdown(gguf_file, ctx_ids[near_4k][0], log=RESULTS / "decode_breakdown.log")
        except Exception as e:  # the grid's figures stand without it
            breakdown = {"error": repr(e)}
            print(f"[decode] served step breakdown failed: {e!r}")
        breakdown["kernels_alone"] = step_breakdown(gguf_file, near_4k, tpot(grid, "loopkv-gguf", near_4k, 1))
    bandwidth = statistics.median(bw)
    limit = {
        "bandwidth_bytes_s": bandwidth,
        "bandwidth_passes_bytes_s": bw,
        "how": "median of 10 torch.sum passes over a 1 GiB float32 tensor, 5 at the start and 5 at the end of the run, "
        f"{torch.get_num_threads()} torch threads",
        "weight_bytes": {dt: facts["params"] * b for dt, b in DTYPE_BYTES.items()},
        "kv_bytes_per_token": {
            dt: facts["layers"] * 2 * facts["kv_heads"] * facts["head_dim"] * b for dt, b in DTYPE_BYTES.items()
        },
        "tpot_ms": {
            dt: {
                f"{L}/{bs}": limit_tpot_ms(facts, dt, L, bs, args.gen, bandwidth)
                for L in contexts
                for bs in batch_sizes
            }
            for dt in DTYPE_BYTES
        },
    }
    if gguf_file is not None:  # the file's bytes once a step, KV in bfloat16 (the GGUF path's default pool)
        limit["weight_bytes"]["gguf"] = file_weight_bytes(gguf_file)
        limit["tpot_ms"]["gguf"] = {
            f"{L}/{bs}": limit_tpot_ms(facts, "bfloat16", L, bs, args.gen, bandwidth, limit["weight_bytes"]["gguf"])
            for L in contexts
            for bs in batch_sizes
        }
    if fid:
        fid.pop("tok")
        fid.pop("extra_ids", None)
        for v in fid["by_context"].values():
            v.pop("ref_ids", None)
            v["ref_logprobs"] = {str(k): lp for k, lp in (v.get("ref_logprobs") or {}).items()}
    max_prompt = mean_new = None
    if pressure:
        rows = [x for modes in pressure.values() for r in modes.values() for x in r["turns"]]
        max_prompt = max(x["prompt_tokens"] or 0 for x in rows)
        last = {}  # per conversation: its last turn's prompt (the whole history) / its turns
        for x in rows:
            last[x["conv"]] = max(last.get(x["conv"], (0, 0)), (x["prompt_tokens"] or 0, x["turn"] + 1))
        mean_new = round(statistics.mean(p / t for p, t in last.values()))
    payload = {
        "config": {
            "argv": sys.argv[1:],
            "contexts": contexts,
            "batch_sizes": batch_sizes,
            "bf16_contexts": bf16_ctx,
            "bf16_batch_sizes": bf16_bs,
            "gen": args.gen,
            "repeats": args.repeats,
            "pool": pool,
            "headline_dtype": headline,
            "systems": {n: {"kind": SYSTEMS[n][0], "dtype": SYSTEMS[n][1], "flags": SYSTEMS[n][2]} for n in names},
            "pressure": {**pc, "max_prompt_tokens": max_prompt, "mean_new_tokens_per_turn": mean_new}
            if convs
            else None,
            "parts": args.parts,
            "name": args.out,
        },
        "model": facts,
        "limit": limit,
        "grid": grid,
        "pressure": pressure,
        "fidelity": fid,
        "gguf_step_breakdown": breakdown,
        "multiturn_dtypes": mtd,
        "failed": failed,
    }
    payload["env"] = env  # the harness finishes this record (the summary reads the CPU's flags)
    payload["summary"] = summarize(payload)
    return {"summary": payload.pop("summary"), **payload}


def refresh(p: dict) -> None:
    p["summary"] = summarize(p)  # the summary follows the code that reads the runs


BENCH = cli.Benchmark("decode", run, report_md, plot, refresh, parts=("grid", "pressure", "fidelity", "multiturn"))


def main() -> None:
    ap = cli.parser(BENCH, __doc__)
    ap.add_argument("--quick", action="store_true", help="contexts 512/2048, bs 1/4, 32 tokens, small pressure run")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), help="grid systems to run (default: all)")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--batch-sizes", type=int, nargs="+")
    ap.add_argument("--gen", type=int, help="generated tokens per request (default 64, quick 32)")
    ap.add_argument("--repeats", type=int, default=2, help="timed batches per grid cell")
    ap.add_argument(
        "--fid-contexts",
        type=int,
        default=3,
        help="contexts per length in the fidelity part, each scored on 128 teacher-forced positions (default 3)",
    )
    ap.add_argument("--pressure-convs", type=int)
    ap.add_argument("--pressure-turns", type=int)
    ap.add_argument(
        "--pressure-per-turn",
        type=int,
        help="target new tokens per turn (default 940: ~880 measured, histories up to ~3.5K)",
    )
    ap.add_argument("--pressure-gen", type=int, help="tokens per answer (default 32)")
    ap.add_argument(
        "--distinct-contexts", action="store_true", help="every request of a batch its own whole context (slow prefill)"
    )
    ap.add_argument("--force-bf16", action="store_true", help="full bf16 grid even without native bf16")
    ap.add_argument(
        "--add-multiturn",
        action="store_true",
        help="run only the multi-turn part and add it to the existing decode.json (its run recorded beside the grid's)",
    )
    cli.main(BENCH, ap)


if __name__ == "__main__":
    main()
