"""The default model served from its GGUF blocks next to its converted float32 weights (``float32``):
``gguf`` (``--model-path`` the converted folder, ``--loopkv-weights gguf``: SGLang loads the folder, the
blocks replace its float weights), ``gguf_file`` (``--model-path`` the GGUF file itself: SGLang's GGUF
loader, no converted folder; ``--kv-cache-dtype auto``: a float32 pool like the others) and
``gguf_plain`` (a plain start: the same file with the launcher's defaults, a bfloat16 KV pool). Start-up
(spawn to first answer), decode TPOT of one request at a ~2K context, the scheduler's memory after
warm-up, and whether they serve the same greedy tokens as ``float32``.

The servers run at once (same flags otherwise; started one after another) and the timed requests
alternate between them, one at a time, so drift in the machine's load hits all alike. Per server the context is prefilled once, untimed
(``max_new_tokens=1``); each repeat then streams ``--gen`` greedy tokens (``ignore_eos``) over the cached
prefix: TPOT = inter-arrival time of streamed chunks, first excluded (:func:`benchmarks.decode.stream_generate`).
Memory: RSS of the scheduler process (the one holding the weights), split into anonymous memory and
file-backed pages (the GGUF file is memory-mapped: its pages count as RssFile once touched).

    python -m benchmarks.studies.gguf_serving            # ~7 min on 2 cores
    python -m benchmarks.studies.gguf_serving --prefill-dtype float32 --out gguf_serving_fp32prefill

``--prefill-dtype`` is every server's ``--loopkv-prefill-dtype`` (the float32 weights ignore it): ``auto``
runs the GGUF servers' prefills on bfloat16 units where the CPU has them, so their greedy tokens can part
from float32's at a near-tie; ``float32`` keeps the dequantized model's arithmetic throughout.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import psutil

from benchmarks.decode import stream_generate
from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.studies import write_results
from sgl_loopkv.server.process import ServerProcess

ARGS = ["--max-total-tokens", "16384", "--mem-fraction-static", "0.5", "--dtype", "float32"]
SYSTEMS = ("float32", "gguf", "gguf_file", "gguf_plain")
#: The GGUF rows and their summary keys' suffixes.
TAGS = (("gguf", ""), ("gguf_file", "_file"), ("gguf_plain", "_plain"))


def system_args(name: str) -> list[str]:
    from sgl_loopkv.config import default_cache_dir
    from sgl_loopkv.models import default_model_gguf, ensure_default_model

    if name == "gguf_file":
        return ["--model-path", str(default_model_gguf()), *ARGS, "--kv-cache-dtype", "auto"]
    if name == "gguf_plain":
        return ["--model-path", str(default_model_gguf()), *ARGS]
    if name == "gguf":  # named: without a model path the launcher serves the file itself (the plain start)
        return ["--model-path", str(ensure_default_model(default_cache_dir())), *ARGS, "--loopkv-weights", "gguf"]
    return [*ARGS, "--loopkv-weights", name]


def with_prefill_dtype(args: list[str], dtype: str) -> list[str]:
    return [*args, "--loopkv-prefill-dtype", dtype]


def scheduler_memory(srv: ServerProcess) -> dict:
    """MB of the server's largest process (the scheduler): RSS, RssAnon, RssFile."""
    procs = [psutil.Process(p) for p in srv.pids()]
    sched = max(procs, key=lambda p: p.memory_info().rss)
    fields = {}
    for line in Path(f"/proc/{sched.pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss_mb": fields["VmRSS"], "anon_mb": fields["RssAnon"], "file_mb": fields["RssFile"]}


def tpot_intervals(run: dict) -> list[float]:
    """Seconds per token between streamed chunks, the first chunk excluded."""
    out = []
    for (t_a, n_a), (t_b, n_b) in zip(run["arrivals"], run["arrivals"][1:]):
        if n_b > n_a:
            out += [(t_b - t_a) / (n_b - n_a)] * (n_b - n_a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=64, help="tokens streamed per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--out", default="gguf_serving", help="results name under benchmarks/results/studies/")
    args = ap.parse_args()
    ids = [random.Random(0).randrange(100, 40000) for _ in range(args.context)]
    logs = Path(tempfile.mkdtemp(prefix="gguf-serving-"))
    servers = {
        w: ServerProcess(with_prefill_dtype(system_args(w), args.prefill_dtype), log_path=logs / f"{w}.log")
        for w in SYSTEMS
    }
    res: dict[str, dict] = {w: {"intervals": [], "outputs": []} for w in SYSTEMS}
    try:
        for w, srv in servers.items():
            srv.start()
            res[w]["startup_s"] = srv.startup_s
        for w, srv in servers.items():  # prefill, untimed; then memory after warm-up
            stream_generate(srv.url, ids, 1)
            res[w]["memory"] = scheduler_memory(srv)
        for _ in range(args.repeats):
            for w, srv in servers.items():
                run = stream_generate(srv.url, ids, args.gen)
                res[w]["intervals"] += tpot_intervals(run)
                res[w]["outputs"].append(run["output_ids"])
                res[w]["cached_tokens_min"] = min(res[w].get("cached_tokens_min", 1 << 30), run["cached_tokens"])
    finally:
        for srv in servers.values():
            srv.stop()
    for w in SYSTEMS:
        iv = res[w].pop("intervals")
        res[w]["tpot_ms_median"] = 1000 * statistics.median(iv)
        res[w]["n_tokens"] = len(iv)
    f32 = res["float32"]
    summary = {}
    for w, tag in TAGS:
        q = res[w]
        same = sum(a == b for a, b in zip(f32["outputs"][0], q["outputs"][0]))
        summary |= {
            f"tpot_ratio_float32_over_gguf{tag}": f32["tpot_ms_median"] / q["tpot_ms_median"],
            f"rss_ratio_float32_over_gguf{tag}": f32["memory"]["rss_mb"] / q["memory"]["rss_mb"],
            f"startup_ratio_gguf{tag}_over_float32": q["startup_s"] / f32["startup_s"],
            f"greedy_tokens_equal{tag}": f"{same}/{len(f32['outputs'][0])}",
            f"greedy_identical{tag}": f32["outputs"][0] == q["outputs"][0],
        }
    payload = {"config": vars(args), "systems": res, "summary": summary, "environment": environment()}
    rows = [
        [
            w,
            f"{r['startup_s']:.1f}",
            f"{r['tpot_ms_median']:.2f}",
            r["n_tokens"],
            *(f"{r['memory'][k]:.0f}" for k in ("rss_mb", "anon_mb", "file_mb")),
        ]
        for w, r in res.items()
    ]
    md = (
        f"# GGUF blocks vs float32 weights, served (SmolLM2-135M-Instruct, Q4_1)\n\n"
        f"One request, {args.context}-token context prefilled untimed, {args.repeats} x {args.gen} greedy tokens streamed, "
        f"`--loopkv-prefill-dtype {args.prefill_dtype}`, "
        f"the servers alternating; scheduler memory after the prefill; start-up = spawn to first answer "
        f"(the servers started one after another). One run.\n\n"
        + md_table(["weights", "start-up s", "TPOT median ms", "tokens", "RSS MB", "anon MB", "file MB"], rows)
        + "\n"
        + "".join(
            f"\n{w}: TPOT float32 / {w} **{summary[f'tpot_ratio_float32_over_gguf{t}']:.2f}x**, RSS float32 / {w} "
            f"**{summary[f'rss_ratio_float32_over_gguf{t}']:.2f}x**, start-up {w} / float32 "
            f"{summary[f'startup_ratio_gguf{t}_over_float32']:.2f}x, greedy tokens equal {summary[f'greedy_tokens_equal{t}']}.\n"
            for w, t in TAGS
        )
    )
    write_results(args.out, payload, md)
    print(md)


if __name__ == "__main__":
    main()
