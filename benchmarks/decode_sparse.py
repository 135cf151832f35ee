"""Sparse decode (issue 14): every policy beside dense sgl-loopkv, in one run.

    python -m benchmarks.decode_sparse [--parts fidelity grid multiturn] [--contexts 2048 4096 8000]

Parts:
- ``fidelity`` (in-process, HF transformers SmolLM2 fp32, the same :class:`SparseDecoder` and native
  kernel the server runs, attention swapped in for decode steps): per context, dense greedy
  reference of ``--gen`` tokens after a question; each policy teacher-forced on it: top-1 agreement,
  mean per-step KL(dense || policy) over the vocabulary, attention-mass recall (share of the dense
  softmax mass on the keys each KV head read, mean over steps, layers and query heads). At a budget
  covering the context every policy must agree on every step (``exact_at_full_budget``).
- ``grid`` (servers): TPOT and tokens/s per policy and dense, contexts x batch sizes, ``--gen``
  tokens per request (benchmarks.decode's harness: the requests of a batch share all but their last
  64 context tokens, so a dense batch reads one KV, mostly from the CPU caches; with
  ``--distinct-contexts`` each request has a context of its own, as several conversations do), with
  the selected fraction and correction rate from each server's /metrics.
- ``multiturn``: benchmarks.multiturn's quick conversations with each policy on; score per
  question position and its ratio to dense.

Writes benchmarks/results/decode_sparse.{json,md,png}.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from benchmarks import conversations as conv
from benchmarks import decode as dec
from benchmarks.common import synthetic_ids
from benchmarks.harness import cli
from benchmarks.harness.plot import figure
from benchmarks.harness.results import load, md_table, write_results
from benchmarks.harness.stats import ratio
from sgl_loopkv.attention.decode import DECODE_POLICIES, DecodeParams
from sgl_loopkv.attention.decode.config import SparseDecodeConfig
from sgl_loopkv.attention.decode.selector import SparseDecoder
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.kernels import paged_decode
from sgl_loopkv.models import ensure_default_model

POLICIES = ["lserve", "freekv", "loopserve"]
DEFAULTS = SparseDecodeConfig()


# --- fidelity: in-process --------------------------------------------------------------------------
class SparseAttention:
    """HF attention function: prefill and dense decode through SDPA; with ``decoder`` set, decode
    steps run the sparse decoder over the layer's cache (slot = position) and record the recall."""

    def __init__(self):
        self.decoder: SparseDecoder | None = None
        self.recall: list[float] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.decoder is None or query.shape[2] != 1:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
            )
        k = key[0].transpose(0, 1).contiguous()  # [L, Hkv, D]: the "pool", slot = position
        v = value[0].transpose(0, 1).contiguous()
        q = query[0, :, 0].unsqueeze(0).contiguous()  # [1, Hq, D]
        out = torch.empty_like(q)
        self.decoder.run(module.layer_idx, q, k, v, scaling, out)
        hkv, g = k.shape[1], q.shape[1] // k.shape[1]
        rows = self.decoder.last_index[0].view(hkv, -1)
        probs = torch.einsum("hgd,lhd->hgl", q[0].view(hkv, g, -1), k).mul_(scaling).softmax(-1)
        kept = torch.stack([probs[h][:, rows[h] // hkv].sum(-1) for h in range(hkv)])
        self.recall.append(kept.mean().item())
        return out.unsqueeze(1), None


def decode_steps(model, cache, first: int, length: int, tokens: list[int], attn: SparseAttention, decoder):
    """Feed ``first`` then ``tokens[:-1]`` one step at a time onto ``cache`` (``length`` tokens);
    returns the log-probabilities after each step [len(tokens), vocab]."""
    attn.decoder, attn.recall = decoder, []
    out = []
    feed = [first, *tokens[:-1]]
    for t, tok in enumerate(feed):
        if decoder is not None:
            decoder.begin([0], [torch.arange(length + t + 1)])
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(logits.float().log_softmax(-1))
    attn.decoder = None
    return torch.stack(out)


def run_fidelity(contexts, gen, tok, model_dir, bar) -> dict:
    from transformers import AttentionInterface, AutoModelForCausalLM

    from benchmarks.restore import turn_ids

    attn = SparseAttention()
    AttentionInterface.register("loopkv_sparse_harness", attn)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="loopkv_sparse_harness"
    )
    model.eval()
    native = paged_decode.load()
    layers = model.config.num_hidden_layers
    res: dict = {"by_context": {}}
    for L in contexts:
        prompt = synthetic_ids(tok, L - len(turn_ids(tok)), seed=77 + L) + turn_ids(tok)
        bar.set_postfix_str(f"fidelity prefill {L}")
        with torch.inference_mode():
            pre = model(input_ids=torch.tensor([prompt]), use_cache=True)
        base_cache, first = pre.past_key_values, int(pre.logits[0, -1].argmax())
        # dense reference: greedy, each step fed its own previous token
        ref, cache = [first], copy.deepcopy(base_cache)
        attn.decoder = None
        dense_lp = []
        for _ in range(gen):
            with torch.inference_mode():
                lg = model(input_ids=torch.tensor([[ref[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
            dense_lp.append(lg.float().log_softmax(-1))
            ref.append(int(lg.argmax()))
        dense_lp = torch.stack(dense_lp)
        targets = torch.tensor(ref[1:])
        bar.update()
        slot = res["by_context"][str(L)] = {"prompt_tokens": len(prompt)}
        runs = [(p, {}) for p in POLICIES] + ([(p, "full") for p in POLICIES] if L == contexts[0] else [])
        for policy, mode in runs:
            bar.set_postfix_str(f"fidelity {policy}{' full budget' if mode else ''} {L}")
            params = DecodeParams.from_config(DEFAULTS)
            if mode == "full":
                params = dataclasses.replace(params, budget=1 << 20, min_context=0)
            sd = SparseDecoder(DECODE_POLICIES.create(policy, params), layers, native)
            sd.keep_index = True
            t0 = time.perf_counter()
            lp = decode_steps(model, copy.deepcopy(base_cache), first, len(prompt), ref[1:], attn, sd)
            agree = (lp.argmax(-1) == targets).float().mean().item()
            kl = (dense_lp.exp() * (dense_lp - lp)).sum(-1).clamp(min=0)
            row = {
                "teacher_forced_agreement": agree,
                "kl_mean": kl.mean().item(),
                "kl_p90": kl.quantile(0.9).item(),
                "attention_recall": statistics.fmean(attn.recall) if attn.recall else None,
                "selected_fraction": sd.stats.selected_fraction,
                "correction_rate": sd.policy.corrections / max(sd.policy.decisions, 1),
                "seconds": time.perf_counter() - t0,
            }
            if mode == "full":
                row["max_abs_logprob_diff"] = (lp - dense_lp).abs().max().item()
                slot.setdefault("full_budget", {})[policy] = row
            else:
                slot[policy] = row
            bar.update()
    return res


# --- grid: servers -----------------------------------------------------------------------------------
def metric_reader():
    from benchmarks.restore import metrics

    last: dict = {}

    def on_cell(url: str, cell: dict) -> None:
        now = metrics(url)
        d = {k: now.get(k, 0.0) - last.get(k, 0.0) for k in now}
        last.update(now)
        cell["selected_fraction"] = now.get("loopkv_decode_selected_fraction")
        sel = d.get("loopkv_decode_selections_total", 0.0)
        cell["correction_rate"] = d.get("loopkv_decode_corrections_total", 0.0) / sel if sel else None
        steps = d.get("loopkv_decode_sparse_steps_total", 0.0)
        cell["recalled_bytes_per_step"] = d.get("loopkv_decode_recalled_bytes_total", 0.0) / steps if steps else None

    return on_cell


def run_grid(contexts, batch_sizes, args, tok, bar) -> dict:
    n_ctx = max(batch_sizes)
    if args.distinct_contexts:  # several conversations: each request reads its own KV from memory
        ctx_ids = {L: [synthetic_ids(tok, L, seed=1000 * L + i) for i in range(n_ctx)] for L in contexts}
    else:  # one context, each request its own last 64 tokens: a batch reads one KV, mostly from cache
        ctx_ids = dec.shared_context_ids(tok, contexts, n_ctx)
    pool = n_ctx * ((max(contexts) + args.gen + 32) // 16 * 16) + 4096
    shared = []
    if args.distinct_contexts:
        # one disk tier for every system's server: the first prefills the contexts (~30 s each at 8K on
        # 2 cores) and stores them, the next ones load them from disk (untimed either way)
        shared = ["--loopkv-tier-disk-dir", tempfile.mkdtemp(prefix="decode-sparse-kv-")]
    out = {}
    try:
        for name in ["dense", *args.policies]:
            flags = ("--enable-metrics", *shared) + (() if name == "dense" else ("--loopkv-decode-policy", name))
            out[name] = dec.run_sglang(
                f"sparse_{name}", "float32", flags, contexts, batch_sizes, ctx_ids, args, pool, bar, None,
                metric_reader(), gguf=args.weights == "gguf",
            )  # fmt: skip
    finally:
        if shared:
            shutil.rmtree(shared[1], ignore_errors=True)
    return out


# --- multi-turn --------------------------------------------------------------------------------------
def run_multiturn(tok, bar, per_task: int = 1) -> dict:
    from benchmarks import multiturn as mt

    convs, hist, pool, host_bytes = dec.quick_multiturn(tok, per_task)
    out = {}
    # sparse from 1K tokens: the quick suite's histories are 1-3.5K, most turns then decode sparse
    for name in ["dense", *POLICIES]:
        flags = () if name == "dense" else ("--loopkv-decode-policy", name, "--loopkv-decode-min-context", "1024")
        rows = mt.run_system(mt.System(f"sparse_mt_{name}", flags, name), convs, hist, pool, host_bytes, bar)["turns"]
        score = {p: mt.mean(x["score"] for x in rows if x["position"] == p) for p in conv.POSITIONS}
        score["all"] = mt.mean(x["score"] for x in rows)
        out[name] = {"score": score, "n_turns": len(rows)}
    return out


# --- summary and report ------------------------------------------------------------------------------
def summarize(p: dict) -> dict:
    grid, fid, mt = p.get("grid") or {}, p.get("fidelity") or {}, p.get("multiturn") or {}
    big = str(max(p["config"].get("grid_contexts") or p["config"]["contexts"]))
    s: dict = {"tpot_speedup_8k": {}, "throughput_speedup_8k_bs8": {}, "teacher_forced_agreement": {},
               "score_ratio_vs_dense_min": {}, "attention_recall": {}, "kl_mean": {}}  # fmt: skip
    for pol in POLICIES:
        c1 = lambda n, bs: (grid.get(n) or {}).get("cells", {}).get(f"{big}/{bs}") or {}  # noqa: E731
        s["tpot_speedup_8k"][pol] = ratio(c1("dense", 1).get("tpot_ms_median"), c1(pol, 1).get("tpot_ms_median"))
        s["throughput_speedup_8k_bs8"][pol] = ratio(c1(pol, 8).get("tok_s"), c1("dense", 8).get("tok_s"))
        rows = [v[pol] for v in (fid.get("by_context") or {}).values() if pol in v]
        s["teacher_forced_agreement"][pol] = min((r["teacher_forced_agreement"] for r in rows), default=None)
        s["attention_recall"][pol] = min((r["attention_recall"] for r in rows), default=None)
        s["kl_mean"][pol] = max((r["kl_mean"] for r in rows), default=None)
        if pol in mt and "dense" in mt:
            rs = [ratio(mt[pol]["score"][q], mt["dense"]["score"][q]) for q in conv.POSITIONS]
            s["score_ratio_vs_dense_min"][pol] = min((r for r in rs if r is not None), default=None)
    full = [r for v in (fid.get("by_context") or {}).values() for r in (v.get("full_budget") or {}).values()]
    s["exact_at_full_budget"] = bool(full) and all(r["teacher_forced_agreement"] == 1.0 for r in full)
    s["context_for_8k_figures"] = int(big)
    return s


def _f(v, nd=2):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def report_md(p: dict) -> str:
    cfg, s = p["config"], p["summary"]
    lines = [f"# sparse decode ({p['env']['when']}; `{cfg['command']}`)", ""]
    lines.append(
        f"SmolLM2-135M-Instruct fp32, default budgets (budget {DEFAULTS.budget} tokens, pages {DEFAULTS.page_size}/"
        f"{DEFAULTS.logical_page}, sink {DEFAULTS.sink}, local {DEFAULTS.local}, lserve reuse {DEFAULTS.reuse}, "
        f"freekv tau {DEFAULTS.tau}, loopserve n_d {DEFAULTS.n_d}, min context {DEFAULTS.min_context}); "
        f"{cfg['gen']} generated tokens; medians. Grid: "
        + ("every request of a batch a context of its own (several conversations)" if cfg.get("distinct_contexts")
           else "the requests of a batch share their context but the last 64 tokens")
        + "."
    )  # fmt: skip
    lines.append("")
    rows = [[pol, _f(s["tpot_speedup_8k"].get(pol)), _f(s["throughput_speedup_8k_bs8"].get(pol)),
             _f(s["teacher_forced_agreement"].get(pol), 3), _f(s["attention_recall"].get(pol), 3),
             _f(s["kl_mean"].get(pol), 3), _f(s["score_ratio_vs_dense_min"].get(pol), 3)] for pol in POLICIES]  # fmt: skip
    lines.append(md_table(
        ["policy", f"TPOT dense/policy {s['context_for_8k_figures']} bs1 (>= 1.4)", "tok/s policy/dense bs8 (>= 3)",
         "teacher-forced top-1 (min over contexts, >= 0.95)", "attention recall (min)", "KL mean (max)",
         "multi-turn score ratio min over positions (>= 0.97)"], rows))  # fmt: skip
    lines += [
        "",
        f"Exact at full budget (every policy agrees with dense on every step): **{s['exact_at_full_budget']}**",
        "",
    ]
    grid = p.get("grid") or {}
    if grid:
        lines += [
            "## Speed: TPOT ms median (p90) / aggregate tok/s / selected fraction (the server's running "
            "total up to the cell) / correction rate (in the cell)",
            "",
        ]
        keys = sorted(
            {k for g in grid.values() for k in g.get("cells", {})}, key=lambda k: tuple(map(int, k.split("/")))
        )
        body = []
        for name, g in grid.items():
            row = [name]
            for k in keys:
                c = g["cells"].get(k)
                row.append("-" if not c else f"{c['tpot_ms_median']:.1f} ({c['tpot_ms_p90']:.0f}) / {c['tok_s']:.1f} / "
                           f"{_f(c.get('selected_fraction'))} / {_f(c.get('correction_rate'))}")  # fmt: skip
            body.append(row)
        lines.append(md_table(["system", *(f"ctx/bs {k}" for k in keys)], body))
        lines.append("")
    fid = (p.get("fidelity") or {}).get("by_context") or {}
    if fid:
        lines += ["## Fidelity vs dense (teacher-forced on dense greedy)", ""]
        body = [[L, pol, _f(r["teacher_forced_agreement"], 3), _f(r["kl_mean"], 4), _f(r["kl_p90"], 4),
                 _f(r["attention_recall"], 3), _f(r["selected_fraction"], 3), _f(r["correction_rate"], 3)]
                for L, v in fid.items() for pol, r in v.items() if pol in POLICIES]  # fmt: skip
        lines.append(md_table(["context", "policy", "top-1 agreement", "KL mean", "KL p90", "attention recall",
                           "selected fraction", "correction rate"], body))  # fmt: skip
        full = [(L, pol, r) for L, v in fid.items() for pol, r in (v.get("full_budget") or {}).items()]
        if full:
            lines += ["", "Full budget: " + ", ".join(
                f"{pol}@{L} agreement {r['teacher_forced_agreement']:.3f}, max |dlogp| {r['max_abs_logprob_diff']:.1e}"
                for L, pol, r in full)]  # fmt: skip
        lines.append("")
    mt = p.get("multiturn") or {}
    if mt:
        per = cfg.get("mt_convs_per_task", 1)
        lines += [f"## Multi-turn score per question position (quick suite, {per} conversation(s) per task, "
                  "sparse from 1024 tokens)", ""]  # fmt: skip
        body = [[n, *(_f(r["score"].get(q), 3) for q in (*conv.POSITIONS, "all")), r["n_turns"]] for n, r in mt.items()]
        lines.append(md_table(["system", *(f"score q@{q}" for q in conv.POSITIONS), "all", "turns"], body))
    return "\n".join(lines) + "\n"


def plot(p: dict, path) -> None:
    grid = p.get("grid") or {}
    if not grid:
        return
    with figure(path, 1, 2, size=(11, 4)) as (_, axes):
        _plot(grid, axes)


def _plot(grid: dict, axes) -> None:
    for ax, bs in zip(axes, sorted({int(k.split("/")[1]) for g in grid.values() for k in g["cells"]})[:2]):
        for name, g in grid.items():
            pts = sorted(
                (int(k.split("/")[0]), c["tpot_ms_median"]) for k, c in g["cells"].items() if k.endswith(f"/{bs}")
            )
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        ax.set(title=f"TPOT, {bs} concurrent request(s)", xlabel="context tokens", ylabel="ms per token")
        ax.grid(alpha=0.3)
        ax.legend()


def run(args, env: dict) -> dict:
    from transformers import AutoTokenizer

    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    contexts = sorted(args.contexts)
    grid_contexts = sorted(args.grid_contexts or contexts)
    payload: dict = {
        "env": env,
        "config": {"command": "python -m benchmarks.decode_sparse " + " ".join(sys.argv[1:]),
                   "contexts": contexts, "grid_contexts": grid_contexts, "batch_sizes": args.batch_sizes,
                   "gen": args.gen, "distinct_contexts": args.distinct_contexts, "mt_convs_per_task": args.mt_convs,
                   "defaults": dataclasses.asdict(DEFAULTS)},
    }  # fmt: skip
    units = (
        ("fidelity" in args.parts) * (len(contexts) * (1 + len(POLICIES)) + len(POLICIES))
        + ("grid" in args.parts) * (1 + len(args.policies)) * len(grid_contexts) * (1 + len(args.batch_sizes))
        + ("multiturn" in args.parts) * 4 * args.mt_convs * dec.MT_UNITS // 2
    )
    if args.add:
        old = load(args.out)
        payload = {**old, **{k: v for k, v in payload.items() if k != "config"}}
        payload.setdefault("runs", []).append(payload["config"]["command"])
    parts = {
        "fidelity": lambda bar: run_fidelity(contexts, args.gen, tok, model_dir, bar),
        "grid": lambda bar: run_grid(grid_contexts, args.batch_sizes, args, tok, bar),
        "multiturn": lambda bar: run_multiturn(tok, bar, args.mt_convs),
    }
    with tqdm(total=units, desc="decode_sparse") as bar:
        for part in [p for p in parts if p in args.parts]:
            payload[part] = parts[part](bar)
            payload["summary"] = summarize(payload)
            write_results(args.out, payload, report_md(payload))  # after every part: a failure keeps the rest
    return payload


def refresh(p: dict) -> None:
    p["summary"] = summarize(p)


BENCH = cli.Benchmark("decode_sparse", run, report_md, plot, refresh, parts=("fidelity", "grid", "multiturn"))


def main() -> None:
    ap = cli.parser(BENCH, __doc__)
    # 7936 + 256 generated = SmolLM2's 8192 positions (the server refuses more)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 7936])
    ap.add_argument("--grid-contexts", type=int, nargs="+", help="grid: these contexts (default: --contexts)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES, help="grid: policies beside dense")
    ap.add_argument("--distinct-contexts", action="store_true",
                    help="grid: every request of a batch a whole context of its own (slow prefill)")  # fmt: skip
    ap.add_argument("--mt-convs", type=int, default=1,
                    help="multiturn: conversations per task (1: the quick suite's 5 conversations, 14 turns)")  # fmt: skip
    ap.add_argument("--add", action="store_true", help="keep the parts already in <name>.json, run --parts")
    ap.add_argument("--weights", choices=["float32", "gguf"], default="float32",
                    help="grid: the default model's float32 conversion or its GGUF file (the plain start's path: "
                    "blocks, bfloat16 KV)")  # fmt: skip
    cli.main(BENCH, ap)


if __name__ == "__main__":
    main()
