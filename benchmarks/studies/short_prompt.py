"""Short chat prompts: sgl-loopkv vs stock SGLang, and what the radix tree's page size costs.

sgl-loopkv runs SGLang's radix tree at 16-token pages (a node's boundaries are the tiers' 16-token
chunks); stock SGLang runs it at page size 1. The tree reuses whole pages only, so a prompt that
shares less than a page with a cached one (a chat template's system prompt and the start of the
user turn) recomputes up to 15 more tokens. This measures that cost where it shows: one-line chat
prompts (the default model's chat template, its default system prompt, a different one-line
question each time, 1 generated token), on servers started side by side and asked in turn
(the order alternating every round), so a drift of the machine hits them alike:

- ``loopkv``: sgl-loopkv's defaults (page size 16);
- ``stock``: ``--loopkv-stock`` (SGLang as shipped: torch_native attention, page size 1);
- ``stock_page16``: stock with ``--page-size 16``: the page size alone, without any sgl-loopkv part;
- ``loopkv_no_tiers``: sgl-loopkv with the host and disk tiers off (no turn is stored);
- ``loopkv_no_split_linear``: sgl-loopkv with ``LOOPKV_NATIVE_LINEAR=0`` (``F.linear``, not the
  split decode-linear kernel).

Per system: median TTFT (and quartiles), median tokens recomputed per prompt (prompt tokens minus
``cached_tokens``), and TTFT / stock's.

    python -m benchmarks.studies.short_prompt             # 30 rounds (~6 min)
    python -m benchmarks.studies.short_prompt --rounds 10
    python -m benchmarks.studies.short_prompt --replot    # table + plot again from short_prompt.json

Run it alone on the machine (``flock /tmp/loopkv_cpu.lock python -m benchmarks.studies.short_prompt``).
Writes benchmarks/results/short_prompt.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from benchmarks.common import timed_generate
from benchmarks.harness.env import environment, machine_label
from benchmarks.harness.results import md_table
from benchmarks.harness.stats import median
from benchmarks.studies import RESULTS, write_results
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import ensure_default_model
from sgl_loopkv.server.process import ServerProcess

# sgl-loopkv on the float32 conversion: what the committed results measured (a plain start serves the GGUF
# file); --loopkv-stock always serves it
F32 = ["--loopkv-weights", "float32"]
SYSTEMS = {
    "loopkv": [*F32],
    "stock": ["--loopkv-stock"],
    "stock_page16": ["--loopkv-stock", "--page-size", "16"],
    "loopkv_no_tiers": [*F32, "--loopkv-tier-host-bytes", "0", "--loopkv-tier-disk-dir", "none"],
    "loopkv_no_split_linear": [*F32],
}
ENV = {"loopkv_no_split_linear": {"LOOPKV_NATIVE_LINEAR": "0"}}  # F.linear instead of the split kernel
WARMUP = 3
TOPICS = ["rivers", "museums", "winter", "harbours", "libraries", "festivals", "bridges", "gardens", "trains"]


def prompt(tok, r: int) -> list[int]:
    """Round ``r``'s one-line chat prompt (the template's default system prompt, then the question)."""
    msg = [{"role": "user", "content": f"Name one fact about {TOPICS[r % len(TOPICS)]} number {r}."}]
    text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def run(rounds: int) -> dict:
    tok = AutoTokenizer.from_pretrained(ensure_default_model(LoopKVConfig().resolved_cache_dir))
    servers = {}
    try:
        for name, flags in SYSTEMS.items():
            servers[name] = ServerProcess(
                [*flags, "--max-total-tokens", "8192"],
                log_path=RESULTS / f"short_prompt_{name}.log",
                env=ENV.get(name, {}),
            ).start()
        for srv in servers.values():  # the system prompt cached, the servers warm
            for r in range(WARMUP):
                timed_generate(srv.url, prompt(tok, 1000 + r), 1)
        ttft = {n: [] for n in servers}
        recomputed = {n: [] for n in servers}
        for r in range(rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                ids = prompt(tok, r)
                res = timed_generate(servers[name].url, ids, 1)
                ttft[name].append(res["ttft_s"])
                recomputed[name].append(len(ids) - res["meta_info"].get("cached_tokens", 0))
                time.sleep(0.1)
    finally:
        for srv in servers.values():
            srv.stop()
    out = {}
    for name in servers:
        q1, _, q3 = statistics.quantiles(ttft[name], n=4)
        out[name] = {
            "ttft_s": median(ttft[name]),
            "ttft_q1_s": q1,
            "ttft_q3_s": q3,
            "ttfts_s": ttft[name],
            "recomputed_tokens": median(recomputed[name]),
            "prompt_tokens": len(prompt(tok, 0)),
        }
    for name in out:
        out[name]["over_stock"] = out[name]["ttft_s"] / out["stock"]["ttft_s"]
    return out


def report_md(p: dict) -> str:
    cfg, res = p["config"], p["systems"]
    head = (
        f"# short_prompt ({p['env']['when']}; `{cfg['command']}`; {cfg['rounds']} rounds, medians)\n\n"
        f"Default model, {machine_label()}: one-line chat prompts ({res['stock']['prompt_tokens']} tokens, "
        "the template's system prompt shared with earlier prompts), 1 generated token, the servers side by "
        "side asked in turn. `recomputed` = prompt tokens minus the tokens the radix tree reused.\n\n"
    )
    rows = [
        [n, r["ttft_s"], f"{r['ttft_q1_s']:.3g}-{r['ttft_q3_s']:.3g}", r["recomputed_tokens"], r["over_stock"]]
        for n, r in res.items()
    ]
    return head + md_table(["system", "TTFT s", "TTFT quartiles s", "recomputed tokens", "TTFT / stock"], rows)


def plot(p: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = p["systems"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot([[1e3 * t for t in r["ttfts_s"]] for r in res.values()], tick_labels=list(res))
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylabel("TTFT ms (one-line chat prompt)")
    ax.set_title("One-line chat prompts: sgl-loopkv, stock and the parts between")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--replot", action="store_true", help="table and plot again from short_prompt.json")
    args = ap.parse_args()
    if args.replot:
        payload = json.loads((RESULTS / "short_prompt.json").read_text())
        write_results("short_prompt", payload, report_md(payload))
        plot(payload, RESULTS / "short_prompt.png")
        return
    payload = {
        "config": {
            "command": "python -m benchmarks.studies.short_prompt "
            + (f"--rounds {args.rounds}" if args.rounds != 30 else ""),
            "rounds": args.rounds,
            "systems": SYSTEMS,
        },  # fmt: skip
        "systems": run(args.rounds),
        "env": environment(),
    }
    md = report_md(payload)
    write_results("short_prompt", payload, md)
    plot(payload, RESULTS / "short_prompt.png")
    print(md)


if __name__ == "__main__":
    main()
