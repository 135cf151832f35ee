"""sgl-loopkv inside a GPU server: the one-run check of issue 56 (``benchmarks/gpu_server.sh`` runs it
on the GPU machine from the carried bundle; ``--dry-run`` runs the same phases on CPU servers).

Random-weight Llama models are generated on the machine (SmolLM2-135M's geometry; Llama-3-8B's with
fewer layers), SmolLM2's tokenizer. Phases (``--phases``, default all):

- ``greedy``: SGLang's own attention backend and radix cache vs ``--attention-backend loopkv`` with
  the tiered radix cache, SmolLM2 geometry, float32 and bfloat16: greedy outputs of a few prompts;
- ``dense``: the same two bfloat16 servers, a batch of ``--batch`` requests: decode TPOT, SGLang's
  over loopkv's (>= 1 means loopkv is no slower);
- ``resume``: loopkv + tiers, a ``--history``-token conversation recomputed, evicted to the host
  tier by another one, resumed: identical output, host tokens reported, TTFT recompute / resume;
- ``sparse``: Llama-3-8B geometry, ``--sparse-context`` tokens x ``--batch`` distinct sequences,
  dense loopkv decode vs ``--loopkv-decode-policy lserve``: TPOT ratio, fraction of keys read.

Writes ``--out`` (JSON, ``summary`` first). Attention-mass recall of the selected pages is not
measured in the server (random weights; see ``benchmarks/decode_sparse.py`` for recall on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmarks.common import synthetic_ids, timed_generate
from sgl_loopkv.server.process import ServerProcess

PHASES = ("greedy", "dense", "resume", "sparse")


@dataclass(frozen=True)
class Geometry:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0


SMOLLM2 = Geometry(576, 1536, 30, 9, 3, 64, 100000.0)
LLAMA3_8B = Geometry(4096, 14336, 32, 32, 8, 128, 500000.0)
TINY = Geometry(128, 256, 2, 4, 2, 64)  # the dry run's stand-in for both (head dim of the native kernels)
VOCAB = 49152  # SmolLM2's tokenizer


def make_model(out: Path, g: Geometry, tokenizer_dir: Path, device: str, seed: int = 0) -> Path:
    """A seeded random-weight Llama of geometry ``g`` saved as an HF folder (bfloat16 weights on CUDA,
    float32 on CPU; servers cast to their ``--dtype``). Normal(0, 0.02) weights and a sharper lm_head
    (x8) as the e2e tests' tiny model: fewer near-ties between greedy candidates."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=g.hidden,
        intermediate_size=g.intermediate,
        num_hidden_layers=g.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        head_dim=g.head_dim,
        rope_theta=g.rope_theta,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    gen = torch.Generator(device).manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype).cpu()

    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    w = {"model.embed_tokens.weight": rand(VOCAB, g.hidden), "lm_head.weight": rand(VOCAB, g.hidden, std=0.16)}
    w["model.norm.weight"] = torch.ones(g.hidden, dtype=dtype)
    for i in range(g.layers):
        p = f"model.layers.{i}."
        for name, shape in (("q", (q, g.hidden)), ("k", (kv, g.hidden)), ("v", (kv, g.hidden)), ("o", (g.hidden, q))):
            w[f"{p}self_attn.{name}_proj.weight"] = rand(*shape)
        w[f"{p}mlp.gate_proj.weight"] = rand(g.intermediate, g.hidden)
        w[f"{p}mlp.up_proj.weight"] = rand(g.intermediate, g.hidden)
        w[f"{p}mlp.down_proj.weight"] = rand(g.hidden, g.intermediate)
        w[f"{p}input_layernorm.weight"] = torch.ones(g.hidden, dtype=dtype)
        w[f"{p}post_attention_layernorm.weight"] = torch.ones(g.hidden, dtype=dtype)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    cfg.save_pretrained(out)  # last: its presence marks a finished folder
    return out


@dataclass
class Run:
    """One driver run's settings (GPU sizes, or the dry run's)."""

    device: str
    history: int
    sparse_context: int
    batch: int
    new_tokens: int
    decode_budget: int  # tokens each KV head reads per sparse decode step
    logs: Path

    def server(self, model: Path, name: str, dtype: str, extra: list[str], loopkv: bool) -> ServerProcess:
        args = ["--model-path", str(model), "--dtype", dtype, "--enable-metrics", *extra]
        if loopkv:  # explicit on both devices: on CUDA the launcher keeps SGLang's own defaults
            args += ["--attention-backend", "loopkv", "--radix-cache-backend", "loopkv", "--page-size", "16"]
        else:
            args += ["--loopkv-stock"]
        if self.device == "cuda":
            args += ["--device", "cuda", "--disable-cuda-graph", "--sampling-backend", "pytorch"]
            args += ["--mem-fraction-static", "0.2"]
        else:
            args += ["--device", "cpu"]
        return ServerProcess(args, log_path=self.logs / f"{name}.log")


def start_all(servers: dict[str, ServerProcess], timeout_s: float = 600) -> dict[str, ServerProcess]:
    """Start the servers together (their start-ups overlap) and wait for all."""
    for s in servers.values():
        s.spawn()
    try:
        for s in servers.values():
            s.wait_ready(timeout_s)
    except Exception:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: dict[str, ServerProcess]) -> None:
    for s in servers.values():
        s.stop()


def metric(url: str, name: str) -> float:
    lines = requests.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name) and not x.startswith("#"))


def batch_tpot(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Send ``prompts`` at once (one decode batch); median TPOT over requests (seconds/token)."""
    results: list[dict] = [{} for _ in prompts]

    def one(i):
        results[i] = timed_generate(url, prompts[i], new_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tpots = [(r["total_s"] - r["ttft_s"]) / max(1, r["tokens"] - 1) for r in results]
    return {"tpot_s": statistics.median(tpots), "ttft_s": statistics.median(r["ttft_s"] for r in results)}


def phase_greedy_dense(run: Run, tok, model: Path, phases: set[str]) -> dict:
    prompts = [synthetic_ids(tok, n, seed=n) for n in (48, 200, 700)]
    out: dict = {}
    for dtype in ("float32", "bfloat16") if "greedy" in phases else ("bfloat16",):
        servers = start_all(
            {
                "sglang": run.server(model, f"sglang-{dtype}", dtype, [], loopkv=False),
                "loopkv": run.server(model, f"loopkv-{dtype}", dtype, [], loopkv=True),
            }
        )
        try:
            if "greedy" in phases:
                outs = {
                    n: [timed_generate(s.url, p, run.new_tokens)["output_ids"] for p in prompts]
                    for n, s in servers.items()
                }
                out[f"greedy_{dtype}"] = {"identical": outs["sglang"] == outs["loopkv"], "outputs": outs}
            if "dense" in phases and dtype == "bfloat16":
                batch = [synthetic_ids(tok, run.history // 4, seed=500 + i) for i in range(run.batch)]
                for s in servers.values():  # warm-up: first-call compiles off the clock
                    batch_tpot(s.url, [p[:64] for p in batch[:2]], 4)
                out["dense"] = {n: batch_tpot(s.url, batch, run.new_tokens) for n, s in servers.items()}
        finally:
            stop_all(servers)
    return out


def phase_resume(run: Run, tok, model: Path) -> dict:
    L = run.history
    extra = ["--max-total-tokens", str(L + L // 4), "--loopkv-tier-host-bytes", str(8 << 30)]
    srv = run.server(model, "loopkv-resume", "bfloat16", extra, loopkv=True).start()
    try:
        hist, other = synthetic_ids(tok, L, seed=L), synthetic_ids(tok, L, seed=L + 1)
        question = tok("\nUser: what was said first?\nAssistant:", add_special_tokens=False)["input_ids"]
        timed_generate(srv.url, synthetic_ids(tok, 64, seed=3), 2)  # warm-up
        first = timed_generate(srv.url, hist + question, run.new_tokens)  # recomputed: nothing cached
        evict = timed_generate(srv.url, other + question, run.new_tokens)  # recomputed; evicts hist to host
        resumed = timed_generate(srv.url, hist + question, run.new_tokens)
        details = resumed["meta_info"].get("cached_tokens_details") or {}
        recompute = statistics.median([first["ttft_s"], evict["ttft_s"]])
        return {
            "history_tokens": L,
            "identical": first["output_ids"] == resumed["output_ids"],
            "host_tokens": details.get("host", 0),
            "cached_tokens_details": details,
            "recompute_ttft_s": recompute,
            "resume_ttft_s": resumed["ttft_s"],
            "recompute_over_resume": recompute / resumed["ttft_s"],
        }
    finally:
        srv.stop()


def phase_sparse(run: Run, tok, model: Path) -> dict:
    n, ctx = run.batch, run.sparse_context
    extra = ["--max-total-tokens", str(n * (ctx + 2 * run.new_tokens) + 4096)]
    sparse = ["--loopkv-decode-policy", "lserve", "--loopkv-decode-min-context", str(ctx // 2)]
    sparse += ["--loopkv-decode-budget", str(run.decode_budget)]
    servers = start_all(
        {
            "dense": run.server(model, "loopkv-dense-8b", "bfloat16", extra, loopkv=True),
            "lserve": run.server(model, "loopkv-lserve-8b", "bfloat16", extra + sparse, loopkv=True),
        }
    )
    try:
        batch = [synthetic_ids(tok, ctx, seed=900 + i) for i in range(n)]
        out = {}
        for name, s in servers.items():
            batch_tpot(s.url, [p[:64] for p in batch[:2]], 4)
            out[name] = batch_tpot(s.url, batch, run.new_tokens)
        out["lserve"]["selected_fraction"] = metric(servers["lserve"].url, "loopkv_decode_selected_fraction")
        out["lserve"]["sparse_steps"] = metric(servers["lserve"].url, "loopkv_decode_sparse_steps")
        out["speedup"] = out["dense"]["tpot_s"] / out["lserve"]["tpot_s"]
        return out
    finally:
        stop_all(servers)


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return "cpu (dry run)"


def summary(results: dict, device: str) -> dict:
    greedy = [results[k]["identical"] for k in ("greedy_float32", "greedy_bfloat16") if k in results]
    resume, sparse, dense = results.get("resume"), results.get("sparse"), results.get("dense")
    return {
        "greedy_identical_full_budget": all(greedy) if greedy else None,
        "tier_resume_identical": (resume["identical"] and resume["host_tokens"] > 0) if resume else None,
        "resume_host_over_recompute_16k": resume["recompute_over_resume"] if resume else None,
        "sparse_decode_tpot_speedup_32k_bs8": sparse["speedup"] if sparse else None,
        "sparse_decode_selected_fraction": sparse["lserve"]["selected_fraction"] if sparse else None,
        "sparse_decode_attention_recall": None,  # not measured in the server (module docstring)
        "dense_tpot_ratio_sglang_over_loopkv": dense["sglang"]["tpot_s"] / dense["loopkv"]["tpot_s"] if dense else None,
        "device": device_name(device),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_server"), help="models and logs")
    p.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2's tokenizer folder")
    p.add_argument("--dry-run", action="store_true", help="CPU servers, tiny models, short contexts")
    p.add_argument("--llama-layers", type=int, default=4, help="layers of the Llama-3-8B-geometry model")
    args = p.parse_args(argv)
    phases = set(args.phases.split(","))
    if not phases <= set(PHASES):
        p.error(f"unknown phases {sorted(phases - set(PHASES))}; choose from {PHASES}")
    from transformers import AutoTokenizer

    device = "cpu" if args.dry_run else "cuda"
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        run = Run(device, history=1024, sparse_context=1024, batch=2, new_tokens=8, decode_budget=256, logs=logs)
        geoms = {"smollm2": TINY, "llama3_8b": TINY}
    else:
        run = Run(device, history=16384, sparse_context=32768, batch=8, new_tokens=32, decode_budget=2048, logs=logs)
        geoms = {"smollm2": SMOLLM2, "llama3_8b": Geometry(**{**LLAMA3_8B.__dict__, "layers": args.llama_layers})}
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    t0, results = time.perf_counter(), {"phases": sorted(phases), "timings_s": {}}

    def timed(name, fn, *a):
        t = time.perf_counter()
        value = fn(*a)
        results["timings_s"][name] = round(time.perf_counter() - t, 1)
        print(f"[{time.perf_counter() - t0:.0f}s] {name} done", file=sys.stderr, flush=True)
        return value

    models = {k: args.work / f"model-{k}-{'dry' if args.dry_run else 'gpu'}" for k in geoms}
    need = {"smollm2"} if phases & {"greedy", "dense", "resume"} else set()
    need |= {"llama3_8b"} if "sparse" in phases else set()
    for k in sorted(need):
        timed(f"model_{k}", make_model, models[k], geoms[k], args.tokenizer, device)
    if phases & {"greedy", "dense"}:
        results.update(timed("greedy_dense", phase_greedy_dense, run, tok, models["smollm2"], phases))
    if "resume" in phases:
        results["resume"] = timed("resume", phase_resume, run, tok, models["smollm2"])
    if "sparse" in phases:
        results["sparse"] = timed("sparse", phase_sparse, run, tok, models["llama3_8b"])
    results["timings_s"]["total"] = round(time.perf_counter() - t0, 1)
    report = {"summary": summary(results, device), **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".part")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out)
    print(json.dumps(report["summary"], indent=1))
    return report


if __name__ == "__main__":
    main()
