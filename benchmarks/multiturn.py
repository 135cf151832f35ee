"""Multi-turn long-context benchmark: LoopServe-style conversations (benchmarks/conversations.py)
played over the OpenAI chat API against every system in one run on this machine.

Conversations are interleaved round-robin (turn 1 of every conversation, then turn 2, ...) into a
device KV pool smaller than their histories, so a returning conversation finds its history evicted
and must recompute or resume it. Per turn: TTFT (streaming), decode speed, cached tokens per tier,
the answer and its score; per system: stored bytes (``/metrics``). Dense sgl-loopkv is the
fidelity reference; stock SGLang must produce the same greedy answers.

    python -m benchmarks.multiturn --quick                 # 5 tasks x 1 conversation, 1-3K tokens
    python -m benchmarks.multiturn                         # full matrix, 1K-8K tokens, llama.cpp included
    python -m benchmarks.multiturn --quick --with-llamacpp # also llama.cpp (installed on demand)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks import conversations as conv
from benchmarks.common import chat_turn, cpu_pool_dtype, model_facts, tier_bytes
from benchmarks.harness import cli
from benchmarks.harness.env import finish, load1
from benchmarks.harness.plot import figure
from benchmarks.harness.results import RESULTS, load, md_table
from benchmarks.harness.stats import mean, median
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import DEFAULT_MODEL_NAME, ensure_default_model
from sgl_loopkv.models.default_model import default_model_gguf
from sgl_loopkv.server.process import ServerProcess, free_port

LLAMACPP_VENV = Path(os.environ.get("LOOPKV_LLAMACPP_VENV", Path.home() / ".cache/sgl-loopkv/llamacpp-venv"))
# min-len 512: the per-turn extends here are 0.3-3K tokens; the default (2048) would leave most dense
SPARSE = ("--loopkv-prefill-policy", "loopserve", "--loopkv-prefill-min-len", "512")
# compressed tiers as benchmarks/restore.py runs them: int8 ("loopkv"), plus Krul's minicache layer
# sharing ("loopkv_share")
INT8 = ("--loopkv-tier-store-dtype", "int8")
KRUL = (*INT8, "--loopkv-share-layers", "minicache")


@dataclass(frozen=True)
class System:
    """One row of the matrix. ``flags`` go to ``python -m sgl_loopkv.launch_server`` (kind sglang)."""

    name: str
    flags: tuple[str, ...] = ()
    what: str = ""
    kind: str = "sglang"  # "sglang" | "llamacpp"
    budget: float = 1.0  # attention-mass coverage of sparse prefill (1 = dense)
    quick: bool = True  # part of --quick
    requires: str | None = None  # a LoopKVConfig option (flag name): the row runs only once that flag exists
    weights: str = "float32"  # --loopkv-weights: "float32" (the committed baseline rows) or "gguf" (the plain start)

    @property
    def available(self) -> bool:
        return self.requires is None or self.requires in LoopKVConfig.option_names()


# an sglang row's weights (System.weights): "float32", the conversion stock SGLang serves and the rows before the
# GGUF path measured (--loopkv-stock serves it anyway); "gguf", the file's blocks over a bfloat16 KV pool, what a
# plain start serves. The gguf rows are scored against "dense" (float32): what the GGUF path costs in answers.
# name -> flags: a new component is one line. --loopkv-stock = SGLang's own CPU configuration
# (torch_native attention, stock radix cache); the other rows add components back one at a time.
SYSTEMS = [
    System("stock", ("--loopkv-stock",), "stock SGLang 0.5.23 (torch_native, stock radix cache)"),
    System("attn", ("--loopkv-stock", "--attention-backend", "loopkv"), "loopkv attention alone"),
    System(
        "tiered",
        (
            "--loopkv-stock",
            "--radix-cache-backend",
            "loopkv",
            "--page-size",
            "16",
            "--loopkv-restore-planner",
            "load_all",
        ),
        "tiered radix cache alone (torch_native attention, loads every stored layer)",
    ),
    System(
        "sparse",
        ("--loopkv-stock", "--attention-backend", "loopkv", *SPARSE),
        "loopkv attention + LoopServe sparse prefill (alpha 0.95), stock radix cache",
        budget=0.95,
    ),
    System(
        "dense",
        (),
        "sgl-loopkv defaults: loopkv attention + tiered cache + Krul restore planner, dense (fidelity reference)",
    ),
    System("int8", INT8, "dense + int8 tiers"),
    System("krul", KRUL, "dense + int8 tiers + Krul cross-layer sharing (minicache)", requires="share_layers"),
    System(
        "all",
        (*SPARSE, *KRUL),
        "everything: loopkv attention + tiered cache + Krul (planner, sharing) + int8 tiers + LoopServe sparse prefill",
        budget=0.95,
    ),
    # score vs budget (full mode)
    System("all-a0.9", (*SPARSE, *KRUL, "--loopkv-prefill-alpha", "0.9"), "all, alpha 0.9", budget=0.9, quick=False),
    System("all-a0.8", (*SPARSE, *KRUL, "--loopkv-prefill-alpha", "0.8"), "all, alpha 0.8", budget=0.8, quick=False),
    # the plain start's path (GGUF blocks), with the mechanisms that are off by default added back
    System("gguf", (), "sgl-loopkv defaults on the GGUF file (a plain start)", weights="gguf"),
    System(
        "gguf-bf16prefill",
        ("--loopkv-prefill-dtype", "bfloat16"),
        "gguf with the prefill's GEMMs and attention on bfloat16 units (float32 sums; the plain start's on AMX)",
        weights="gguf",
        quick=False,
    ),
    System(
        "gguf-splitsoftmax",
        ("--loopkv-prefill-softmax", "split"),
        "gguf with a bfloat16 prefill's softmax weights split in two bfloat16 parts, named (the default; in "
        "`multiturn_gguf_softmax` `gguf` rounded them once)",
        weights="gguf",
        quick=False,
    ),
    System(
        "gguf-fp32prefill",
        ("--loopkv-prefill-dtype", "float32"),
        "gguf with float32 prefills (the dequantized model's arithmetic; the plain start's where the CPU has "
        "neither AMX-BF16 nor AVX512-BF16)",
        weights="gguf",
        quick=False,
    ),
    System("gguf-int8", INT8, "gguf + int8 tiers", weights="gguf", quick=False),
    System(
        "gguf-sparse", SPARSE, "gguf + LoopServe sparse prefill (alpha 0.95)", weights="gguf", budget=0.95, quick=False
    ),
    System(
        "gguf-all",
        (*SPARSE, *KRUL),
        "gguf + int8 tiers + Krul sharing + LoopServe sparse prefill",
        weights="gguf",
        budget=0.95,
        quick=False,
        requires="share_layers",
    ),
    System("llamacpp", (), "llama.cpp server (llama-cpp-python), same GGUF, prompt cache on", kind="llamacpp"),
]


# --- llama.cpp peer ------------------------------------------------------------------------------
def llamacpp_python() -> Path:
    return LLAMACPP_VENV / "bin" / "python"


def install_llamacpp() -> None:
    """llama-cpp-python[server] into its own venv (compiles llama.cpp: minutes on 2 cores)."""
    if not llamacpp_python().exists():
        subprocess.run(["python3", "-m", "venv", str(LLAMACPP_VENV)], check=True)
    subprocess.run(
        [str(llamacpp_python()), "-m", "pip", "install", "-q", "llama-cpp-python[server]"],
        check=True,
        env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())},
    )


def llamacpp_version() -> str | None:
    if not llamacpp_python().exists():
        return None
    r = subprocess.run(
        [str(llamacpp_python()), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True
    )
    return r.stdout.strip() if r.returncode == 0 else None


# llama_cpp.server with weight repacking off: llama-cpp-python 0.3.36's CPU repack ("extra buffer
# types") segfaults in llama_decode on this machine's CPU (AVX-512 + AMX) with the Q4_1 GGUF; the
# plain CPU path runs. The model-params default is the only switch the server does not expose.
_LLAMACPP_MAIN = """
import sys, llama_cpp.llama_cpp as C
from llama_cpp.server.__main__ import main
_default = C.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
sys.argv[0] = "llama_cpp.server"
main()
"""


@dataclass
class LlamaCppServer:
    n_ctx: int
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300) -> LlamaCppServer:
        threads = str(os.cpu_count())
        cmd = [
            str(llamacpp_python()), "-c", _LLAMACPP_MAIN, "--model", str(default_model_gguf()),
            "--model_alias", DEFAULT_MODEL_NAME, "--n_ctx", str(self.n_ctx), "--n_threads", threads,
            "--n_threads_batch", threads, "--seed", "0", "--verbose", "true",
            # its prompt cache: the KV state of earlier prompts in RAM, reused for a longest prefix. 1 GB:
            # llama-cpp-python counts an entry's llama state against it, but each entry also keeps a copy
            # of its prompt's logits (tokens x 49152 floats, 1.6 GB at 8K): at 2 GB a full run's entries
            # grew the server to 24 GB and the OOM killer. The quick run's five histories still all fit.
            "--cache", "true", "--cache_type", "ram", "--cache_size", str(1 << 30),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        t0 = time.perf_counter()
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited; log: {self.log_path}")
            try:
                if requests.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"llama.cpp server not ready; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# --- one system ------------------------------------------------------------------------------------
def run_system(sys_: System, convs, hist_tokens, pool: int, host_bytes: int, bar) -> dict:
    log = RESULTS / f"multiturn_{sys_.name}.log"
    disk = Path(tempfile.mkdtemp(prefix="loopkv-multiturn-"))
    if sys_.kind == "llamacpp":
        srv = LlamaCppServer(n_ctx=pool, log_path=log)
    else:
        tiers = ["--loopkv-tier-host-bytes", str(host_bytes), "--loopkv-tier-disk-dir", str(disk)]
        args = [
            *sys_.flags,
            "--loopkv-weights",
            sys_.weights,
            "--max-total-tokens",
            str(pool),
            "--enable-metrics",
            *tiers,
        ]
        srv = ServerProcess(args, log_path=log)
    turns, stored, t0 = [], {}, time.perf_counter()
    try:
        srv.start()
        for t in range(max(len(c.turns) for c in convs)):  # round-robin: histories get evicted, then resumed
            for c in convs:
                if t >= len(c.turns):
                    continue
                bar.set_postfix_str(f"{sys_.name} {c.id} turn {t}")
                turn = c.turns[t]
                res = chat_turn(srv.url, c.messages(t), turn.max_tokens, sys_.kind)
                res.update(
                    conv=c.id,
                    task=c.task,
                    turn=t,
                    position=turn.position,
                    evidence_earlier_only=max(turn.depends_on) < t,
                    history_tokens=hist_tokens[c.id][t],
                    score=conv.score(turn, res["answer"]),
                )
                turns.append(res)
                bar.update()
        if sys_.kind == "sglang":
            stored = tier_bytes(srv.url)
    finally:
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)
    return {"startup_s": srv.startup_s, "wall_s": time.perf_counter() - t0, "turns": turns, "tier_bytes": stored}


# --- report ----------------------------------------------------------------------------------------
def summarize(results: dict, systems: list[System], history_total: int) -> dict:
    dense = {(x["conv"], x["turn"]): x for x in results["dense"]["turns"]}
    groups = {"all": lambda x: True, **{p: (lambda x, p=p: x["position"] == p) for p in conv.POSITIONS}}
    per = {}
    for s in systems:
        rows = results[s.name]["turns"]
        score = {g: mean(x["score"] for x in rows if f(x)) for g, f in groups.items()}
        dscore = {g: mean(x["score"] for x in dense.values() if f(x)) for g, f in groups.items()}
        tb = results[s.name]["tier_bytes"]
        kept = tb.get("disk") or tb.get("host")  # host is written through to disk: count one copy
        tiers = defaultdict(int)
        for x in rows:
            for k, v in (x["cached_details"] or {}).items():
                if isinstance(v, int):
                    tiers[k] += v
        per[s.name] = {
            "what": s.what,
            "budget": s.budget,
            "score": score,
            "score_by_task": {t: mean(x["score"] for x in rows if x["task"] == t) for t in conv.TASKS},
            "score_evidence_earlier_only": mean(x["score"] for x in rows if x["evidence_earlier_only"]),
            "score_ratio_vs_dense": {g: (score[g] / dscore[g] if dscore[g] else None) for g in groups},
            "same_answer_as_dense": mean(x["answer"] == dense[(x["conv"], x["turn"])]["answer"] for x in rows),
            "ttft_median_s": median([x["ttft_s"] for x in rows]),
            "turn_median_s": median([x["total_s"] for x in rows]),
            "tpot_median_s": median([x["tpot_s"] for x in rows if x["tpot_s"]])
            if any(x["tpot_s"] for x in rows)
            else None,
            "prompt_tokens": sum(x["history_tokens"] for x in rows),
            "cached_tokens": {k: v for k, v in tiers.items()} or {"total": sum(x["cached_tokens"] or 0 for x in rows)},
            "stored_bytes": tb,
            "stored_bytes_per_token": kept / history_total if kept else None,
            "startup_s": results[s.name]["startup_s"],
        }
    for s in per.values():
        s["ttft_ratio_vs_stock"] = per["stock"]["ttft_median_s"] / s["ttft_median_s"]
    return per


def gguf_vs_float32(per: dict) -> dict:
    """The GGUF path's rows against the float32 one: each row's score per question position over dense's
    (the float32 row of the same defaults) and the worst of them, and its whole-turn and first-token
    times. Keys ``gguf_*`` for the plain start's row, ``gguf_bf16prefill_*`` for bfloat16 prefills."""
    out, d = {}, per["dense"]
    for row in ("gguf", "gguf-bf16prefill"):
        if row not in per:
            continue
        g, key = per[row], row.replace("-", "_")
        by_pos = {q: g["score_ratio_vs_dense"][q] for q in conv.POSITIONS}
        out |= {
            f"{key}_score_ratio_vs_fp32": by_pos,
            f"{key}_score_ratio_vs_fp32_min": min((v for v in by_pos.values() if v is not None), default=None),
            f"fp32_over_{key}_turn": d["turn_median_s"] / g["turn_median_s"],
            f"fp32_over_{key}_ttft": d["ttft_median_s"] / g["ttft_median_s"],
        }
    return out


def gguf_line(sm: dict) -> str:
    lines = []
    for row in ("gguf", "gguf-bf16prefill"):
        key = row.replace("-", "_")
        if f"{key}_score_ratio_vs_fp32" not in sm:
            continue
        each = ", ".join(
            f"q@{q} {'-' if v is None else f'{v:.3f}'}" for q, v in sm[f"{key}_score_ratio_vs_fp32"].items()
        )
        worst = sm[f"{key}_score_ratio_vs_fp32_min"]
        lines.append(
            f"GGUF path (`{row}`) against the float32 path (`dense`): score per question position {each} "
            f"(worst {'-' if worst is None else f'{worst:.3f}'}x; target >= 0.99x); whole turn "
            f"{sm[f'fp32_over_{key}_turn']:.2f}x and TTFT {sm[f'fp32_over_{key}_ttft']:.2f}x faster (medians).\n\n"
        )
    return "".join(lines)


def report_md(payload: dict) -> str:
    sm, per = payload["summary"], payload["summary"]["per_system"]
    pct = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    rows = []
    for name in sm["systems"]:
        p = per[name]
        # results stored before the summary kept it: the same median from the turns
        turn_s = p.get("turn_median_s") or median(x["total_s"] for x in payload["results"][name]["turns"])
        c = p["cached_tokens"]
        cached = "/".join(str(c.get(k, 0)) for k in ("device", "host", "storage")) if "device" in c else "-"
        rows.append(
            [
                name,
                pct(p["score"]["all"]),
                *(pct(p["score"][q]) for q in conv.POSITIONS),
                pct(p["score_evidence_earlier_only"]),
                pct(p["score_ratio_vs_dense"]["all"]),
                pct(p["same_answer_as_dense"]),
                p["ttft_median_s"],
                p["ttft_ratio_vs_stock"],
                "-" if p["tpot_median_s"] is None else round(1000 * p["tpot_median_s"], 1),
                round(turn_s, 2),
                cached,
                "-" if p["stored_bytes_per_token"] is None else round(p["stored_bytes_per_token"]),
            ]
        )
    env = payload["env"]
    n_added = sum(len(a["systems"]) for a in env.get("added", []))  # their run's own wall time is below
    head = (
        f"# multiturn ({env['when']}, {payload['config']['mode']}: {len(payload['conversations'])} conversations, "
        f"{payload['n_turns']} turns, {min(payload['config']['lengths'])}-{max(payload['config']['lengths'])} tokens, "
        f"device pool {payload['config']['pool_tokens']} tokens; load avg {load1(env['loadavg_start']):.1f} -> "
        f"{load1(env['loadavg_end']):.1f}"
        + (f"; {env['wall_s'] / 60:.1f} min wall for {len(sm['systems']) - n_added} systems" if "wall_s" in env else "")
        + ")\n\n"
        + "".join(
            f"Added by a later run (`--add`): {', '.join(f'`{n}`' for n in a['systems'])} ({a['when']}, commit "
            f"{(a.get('git') or {}).get('commit', '?')[:10]}; load avg {load1(a['loadavg_start']):.1f} -> "
            f"{load1(a['loadavg_end']):.1f}; {a.get('wall_s', 0) / 60:.1f} min).\n\n"
            for a in env.get("added", [])
        )
    )
    t1 = md_table(
        [
            "system",
            "score",
            *(f"score q@{q}" for q in conv.POSITIONS),
            "score, evidence only in earlier turns",
            "score / dense",
            "same answer as dense",
            "TTFT median s",
            "TTFT stock / system x",
            "TPOT median ms",
            "turn median s (request to last token)",
            "cached tokens device/host/disk",
            "stored bytes/token",
        ],
        rows,
    )
    t2 = md_table(
        ["system", *conv.TASKS], [[n, *(pct(per[n]["score_by_task"][t]) for t in conv.TASKS)] for n in sm["systems"]]
    )
    whats = "\n".join(f"- `{n}`: {per[n]['what']}" for n in sm["systems"])
    return (
        head
        + t1
        + "\nScore by task:\n\n"
        + t2
        + f"\nDense sgl-loopkv answers identical to stock SGLang (greedy, every turn): "
        f"**{sm['dense_identical_to_stock']}**. llama.cpp: {payload['config']['llamacpp_version'] or 'not run'}.\n\n"
        + gguf_line(sm)
        + whats
        + "".join(f"\n- `{n}` failed: {e}" for n, e in sm.get("failed", {}).items())
        + "\n"
    )


def plot(payload: dict, path: Path) -> None:
    sm, results = payload["summary"], payload["results"]
    with figure(path, 1, 2, size=(13, 4.4), gridspec_kw={"width_ratios": [7, 6]}) as (_, (ax, ax2)):
        edges = [0, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 1 << 20]
        for i, name in enumerate(sm["systems"]):
            rows = results[name]["turns"]
            xs, ys = [], []
            for lo, hi in zip(edges, edges[1:]):
                b = [x for x in rows if lo <= x["history_tokens"] < hi]
                if b:
                    xs.append(median([x["history_tokens"] for x in b]))
                    ys.append(median([x["ttft_s"] for x in b]))
            ax.plot(xs, ys, "-o", color=f"C{i}", label=name, alpha=0.85)
        ax.set(
            xscale="log", yscale="log", xlabel="prompt incl. history (tokens, bin median)", ylabel="TTFT (s, median)"
        )
        ax.set_title("Multi-turn TTFT vs history length (interleaved conversations)")
        ax.legend(fontsize=8)
        per, points = sm["per_system"], defaultdict(list)
        for name in sm["systems"]:
            if name != "llamacpp":  # no budget knob
                points[(per[name]["budget"], round(per[name]["score"]["all"], 4))].append(name)
        for i, ((x, y), names) in enumerate(sorted(points.items())):
            ax2.scatter(x, y, color=f"C{i}")
            ax2.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(-8, 6), ha="right", fontsize=8)
        ax2.margins(x=0.3, y=0.2)
        ax2.set(xlabel="sparse-prefill budget (attention mass kept; 1 = dense)", ylabel="mean score")
        ax2.set_title("Score vs sparse-prefill budget")


def run(args, env: dict) -> dict:
    prev = load(args.out) if args.add else None  # --add: the stored run's conversations, its systems kept
    if prev is not None:
        if not args.systems:
            raise SystemExit("--add runs the systems named by --systems")
        args.quick, args.seed = prev["config"]["mode"] == "quick", prev["config"]["seed"]
        args.convs_per_task = prev["config"]["convs_per_task"]
    quick = args.quick
    lengths = [1024, 2048, 3072] if quick else [1024, 2048, 4096, 8192]
    n_per_task = args.convs_per_task or (1 if quick else 4)
    turn_range = (2, 3) if quick else (2, 5)

    systems = [s for s in SYSTEMS if s.available and (s.quick or not quick)]
    if prev is not None:
        systems = [s for s in SYSTEMS if s.available and s.name in args.systems]
    elif args.systems:
        systems = [s for s in systems if s.name in {*args.systems, "stock", "dense"}]
    want_llama = any(s.kind == "llamacpp" for s in systems) and (args.with_llamacpp or not quick)
    if want_llama and llamacpp_version() is None:
        print("installing llama-cpp-python[server] into", LLAMACPP_VENV, "(compiles; several minutes)")
        install_llamacpp()
    systems = [s for s in systems if s.kind != "llamacpp" or (want_llama and llamacpp_version())]

    from transformers import AutoTokenizer

    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    kv_bytes_per_token = model_facts(model_dir).kv_bytes_per_token(cpu_pool_dtype()[1])
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    convs = conv.suite(conv.TASKS, n_per_task, lengths, turn_range, args.seed, count)
    hist_tokens = {}
    for c in convs:
        conv.attach_token_spans(c, tok)
        hist_tokens[c.id] = [
            count(tok.apply_chat_template(c.messages(t), tokenize=False, add_generation_prompt=True))
            for t in range(len(c.turns))
        ]
    longest = max(max(h) for h in hist_tokens.values())
    pool = (longest + 64 + 15) // 16 * 16 + 256  # fits the longest request, not two histories
    # every conversation's final history (last prompt + reply): what a tiered cache ends up keeping
    history_total = sum(hist_tokens[c.id][-1] + count(c.turns[-1].gold_reply) for c in convs)
    host_bytes = int(0.25 * history_total * kv_bytes_per_token)  # a quarter in RAM: the rest from disk
    n_turns = sum(len(c.turns) for c in convs)

    env["t_start"] = time.monotonic()  # after any llama.cpp install: the run itself
    results, failed = {}, {}
    with tqdm(total=n_turns * len(systems), desc="multiturn") as bar:
        for s in systems:
            try:
                results[s.name] = run_system(s, convs, hist_tokens, pool, host_bytes, bar)
            except Exception as e:  # one broken system must not cost the others' measurements
                if s.name in ("stock", "dense"):
                    raise
                failed[s.name] = repr(e)
                print(f"[multiturn] {s.name} failed: {e!r}")
    if prev is not None:  # merged into the stored run, rows in the matrix's order
        results = {**prev["results"], **results}
        failed = {k: v for k, v in {**prev["summary"].get("failed", {}), **failed}.items() if k not in results}
        prev["env"].setdefault("added", []).append({"systems": [s.name for s in systems], **finish(env)})
        env = prev["env"]
        systems = [s for s in SYSTEMS if s.name in results]
    systems = [s for s in systems if s.name in results]

    per = summarize(results, systems, history_total)
    dense_ans = [x["answer"] for x in results["dense"]["turns"]]
    summary = {
        "systems": [s.name for s in systems],
        "score_ratio_vs_dense": {n: p["score_ratio_vs_dense"] for n, p in per.items()},
        "ttft_median_s": {n: p["ttft_median_s"] for n, p in per.items()},
        "tpot_median_s": {n: p["tpot_median_s"] for n, p in per.items()},
        "turn_median_s": {n: p["turn_median_s"] for n, p in per.items()},
        **gguf_vs_float32(per),
        "dense_identical_to_stock": dense_ans == [x["answer"] for x in results["stock"]["turns"]],
        "failed": failed,
        "per_system": per,
    }
    return {
        **({"env": env} if prev is not None else {}),
        "summary": summary,
        "config": {
            "mode": "quick" if quick else "full",
            "seed": args.seed,
            "lengths": lengths,
            "turns": turn_range,
            "convs_per_task": n_per_task,
            "pool_tokens": pool,
            "host_bytes": host_bytes,
            "systems": {s.name: asdict(s) for s in systems},
            "llamacpp_version": llamacpp_version() if any(s.kind == "llamacpp" for s in systems) else None,
        },
        "n_turns": n_turns,
        "conversations": [
            {"id": c.id, "task": c.task, "turns": len(c.turns), "history_tokens": hist_tokens[c.id]} for c in convs
        ],
        "results": results,
    }


BENCH = cli.Benchmark("multiturn", run, report_md, plot)


def main() -> None:
    ap = cli.parser(BENCH, __doc__)
    ap.add_argument("--quick", action="store_true", help="quick subset (under 10 minutes on 2 cores)")
    ap.add_argument("--with-llamacpp", action="store_true", help="include llama.cpp (install it if missing)")
    ap.add_argument("--systems", nargs="+", help="run only these systems (stock and dense are always run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--convs-per-task", type=int)
    ap.add_argument(
        "--add",
        action="store_true",
        help="run only --systems on the stored <out>.json's conversations and merge them in (a system that "
        "failed or is new; the added run's time and load are recorded beside the first run's)",
    )
    cli.main(BENCH, ap)


if __name__ == "__main__":
    main()
