"""Several sgl-loopkv workers behind sglang-router, with and without the shared disk tier (issue 17).

The multi-turn conversations of benchmarks/conversations.py (gold replies as history, as in
benchmarks/multiturn.py), chat-templated and played by ``--clients`` concurrent clients through the
router (``/generate``, greedy), against each configuration in one run:

- ``1w``: one worker with both cores (the router in front too, for the same path);
- ``2w-shared-*``: two workers of one core each sharing one disk tier (``launch_cluster``);
- ``2w-private-*``: the same two workers, each with its own tiers (``--loopkv-disk-dir none``: a
  private host arena each, nothing shared);

- ``3w-shared-rr`` / ``3w-private-rr``: three workers of one thread (two of them share a core; with
  two clients at most two turns run at once), where a conversation's turn finds a worker that
  served it three turns before, or none of it (summary keys ending ``_3w``);

- ``4w-shared-rr`` / ``4w-private-rr`` (opt-in, ``--configs``): four workers, two per core, where
  most worker-changing turns find a worker that never saw the conversation (keys ending ``_4w``);

- ``2w-shared-ca-failover`` / ``2w-private-ca-failover``: the failover drill. Two workers under
  ``cache_aware`` play every conversation's turns before turn ``FAILOVER_TURN``; then the worker that
  served the most of those conversations last is killed with ``kill -9``, the router's health checks
  take it out (that wait is reported, not timed into any turn), and the survivor plays the rest. A
  *failover* turn is the first turn of a conversation whose previous turn the dead worker served:
  with a shared tier the survivor resumes it from the dead worker's segments, with private tiers it
  recomputes the whole history (summary keys ``*_failover``);

each under the router's ``round_robin`` (``-rr``: a conversation's next turn lands on either worker)
and ``cache_aware`` (``-ca``: the router sends a conversation back to the worker that has its prefix)
policies. Per turn: the worker that served it (``cached_tokens_details.worker``), TTFT, cached tokens
by source (``storage_shared`` = from segments another worker stored). A *cross-worker* turn is a
returning turn served by another worker than the conversation's previous turn.

Two conversation shapes (``--shapes``, default both), the same documents and questions:

- ``loopserve`` (the summary's plain keys): as benchmarks/conversations.py makes them, LoopServe's
  shape: every turn brings new context (~500-700 tokens here) with its question. A private worker
  that served turn t-2 recomputes turns t-1 and t where a shared one prefills turn t (~2x; more on
  a worker that had none of the conversation);
- ``followup`` (keys ending ``_followup``): the common chat pattern, built from the same
  conversations by :func:`followup`: all the context arrives in the first turn, every later turn is
  a short question about it. A private worker that served any earlier turn recomputes only a short
  question and reply; one that had none of the conversation recomputes the whole context. Played by
  ``--followup-configs`` (default the two- and three-worker ``round_robin`` pairs and the failover pair, about 20 min more).

    python -m benchmarks.cluster                       # SmolLM2, 5 conversations of 5-6 turns, 3-4K tokens, 2 clients (~45 min)
    python -m benchmarks.cluster --convs-per-task 2    # twice the conversations
    python -m benchmarks.cluster --shapes followup     # the follow-up shape alone (~20 min)
"""

from __future__ import annotations

import copy
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from benchmarks import conversations as conv
from benchmarks.harness import cli
from benchmarks.harness.env import load1
from benchmarks.harness.plot import figure
from benchmarks.harness.results import md_table
from benchmarks.harness.stats import nearest_rank as pct
from benchmarks.harness.stats import ratio
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import ensure_default_model
from sgl_loopkv.server.cluster import Cluster


@dataclass(frozen=True)
class Config:
    name: str
    workers: int
    shared: bool
    policy: str
    what: str
    kill_before_turn: int | None = None  # failover drill: kill -9 one worker before this turn


FAILOVER_TURN = 3  # histories of ~1.5-2K tokens (LoopServe-style) or the whole context (follow-up)
CONFIGS = [
    Config("1w", 1, True, "round_robin", "one worker, 2 threads"),
    Config("2w-shared-rr", 2, True, "round_robin", "two workers x 1 thread, one shared disk tier, round_robin"),
    Config("2w-private-rr", 2, False, "round_robin", "two workers x 1 thread, private tiers, round_robin"),
    Config("2w-shared-ca", 2, True, "cache_aware", "two workers x 1 thread, one shared disk tier, cache_aware"),
    Config("2w-private-ca", 2, False, "cache_aware", "two workers x 1 thread, private tiers, cache_aware"),
    # a third worker: a conversation's turn lands on a worker that saw it three turns before, or never
    Config("3w-shared-rr", 3, True, "round_robin", "three workers x 1 thread (two share a core), shared tier"),
    Config("3w-private-rr", 3, False, "round_robin", "three workers x 1 thread (two share a core), private tiers"),
    # four: a worker-changing turn mostly finds a worker that never saw the conversation (opt-in, ~20 min)
    Config("4w-shared-rr", 4, True, "round_robin", "four workers x 1 thread (two per core), shared tier"),
    Config("4w-private-rr", 4, False, "round_robin", "four workers x 1 thread (two per core), private tiers"),
    # a worker lost: its conversations move to the survivor
    Config(
        "2w-shared-ca-failover",
        2,
        True,
        "cache_aware",
        f"two workers x 1 thread, shared tier, cache_aware; kill -9 of one before turn {FAILOVER_TURN}",
        FAILOVER_TURN,
    ),
    Config(
        "2w-private-ca-failover",
        2,
        False,
        "cache_aware",
        f"two workers x 1 thread, private tiers, cache_aware; kill -9 of one before turn {FAILOVER_TURN}",
        FAILOVER_TURN,
    ),
]
FAILOVER_PAIR = ("2w-shared-ca-failover", "2w-private-ca-failover")
OPT_IN = ("4w-shared-rr", "4w-private-rr")  # not in a default run
EXTRA_RR = {3: "_3w", 4: "_4w"}  # round_robin pairs beyond two workers: their summary keys' suffix


SHAPES = ("loopserve", "followup")
FOLLOWUP_CONFIGS = ("2w-shared-rr", "2w-private-rr", "3w-shared-rr", "3w-private-rr", *FAILOVER_PAIR)
CUMULATIVE_TASKS = ("count", "vartrack")  # questions over "everything said so far"


def followup(c: conv.Conversation) -> conv.Conversation:
    """``c`` in the follow-up shape: the first user message holds every turn's context (its user
    message less its question paragraph), one paragraph per turn in turn order, then the first
    question; every later user message is that turn's question alone. Questions, gold replies,
    ``max_tokens`` and scoring are ``c``'s, except where a question counts over everything said so
    far (``count``, ``vartrack``): all of it is said in the first message, so every turn's gold reply
    is the last turn's. Evidence spans are dropped (nothing here reads them)."""

    def context(turn: conv.Turn) -> str:
        paras = turn.user.split("\n\n")  # _render: the question is a paragraph of its own
        assert paras.count(turn.question) == 1, turn.question
        return " ".join(x for x in paras if x != turn.question)

    first = "\n\n".join([*(context(t) for t in c.turns), c.turns[0].question])
    cumulative = c.task in CUMULATIVE_TASKS
    turns = [
        conv.Turn(
            first if i == 0 else t.question,
            t.question,
            copy.copy(c.turns[-1].answer if cumulative else t.answer),
            t.metric,
            "end",
            [0],
            [],
            t.max_tokens,
        )
        for i, t in enumerate(c.turns)
    ]
    return conv.Conversation(f"{c.id}-followup", c.task, c.seed, c.target_tokens, turns)


def generate_turn(url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one greedy ``/generate`` of the chat-templated prompt text; TTFT = first chunk.

    ``/generate``, not the OpenAI chat API: sglang-router 0.3 re-serializes chat requests and drops
    SGLang's ``return_cached_tokens_details``; ``/generate`` reports ``cached_tokens_details`` (which
    worker served a turn, and from where) whenever the workers run with ``--enable-cache-report``.
    The text (not token ids) keeps ``cache_aware`` routing meaningful: the router matches on it."""
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
    }
    t0 = time.perf_counter()
    ttft, last = None, None
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            last = json.loads(line[len(b"data: ") :])
            ttft = ttft or time.perf_counter() - t0
    meta = last["meta_info"]
    return {
        "ttft_s": ttft,
        "total_s": time.perf_counter() - t0,
        "completion_tokens": meta.get("completion_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "cached_details": meta.get("cached_tokens_details"),
        "answer": last["text"],
    }


def play(url: str, convs: list[conv.Conversation], clients: int, tok, turns_from: int = 0, turns_to=None) -> list[dict]:
    """Every conversation's turns ``[turns_from, turns_to)`` in order, ``clients`` conversations at a
    time (earlier turns are in each prompt as history, with gold replies)."""
    todo: queue.Queue[conv.Conversation] = queue.Queue()
    for c in convs:
        todo.put(c)
    turns, lock, errors = [], threading.Lock(), []
    t0 = time.perf_counter()

    def client():
        while True:
            try:
                c = todo.get_nowait()
            except queue.Empty:
                return
            for t, turn in list(enumerate(c.turns))[turns_from:turns_to]:
                start = time.perf_counter() - t0
                try:
                    prompt = tok.apply_chat_template(c.messages(t), tokenize=False, add_generation_prompt=True)
                    res = generate_turn(url, prompt, turn.max_tokens)
                except Exception as e:  # recorded: a failed turn counts against the configuration
                    errors.append(repr(e))
                    break
                details = res.pop("cached_details") or {}
                res |= {
                    "conv": c.id,
                    "turn": t,
                    "start_s": start,
                    "end_s": time.perf_counter() - t0,
                    "worker": details.get("worker"),
                    "device": details.get("device", 0),
                    "host": details.get("host", 0),
                    "storage": details.get("storage", 0),
                    "storage_shared": details.get("storage_shared", 0),
                    "score": conv.score(turn, res["answer"]),
                }
                with lock:
                    turns.append(res)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} turns failed: {errors[:3]}")
    return sorted(turns, key=lambda x: (x["conv"], x["turn"]))


def mark_cross_worker(turns: list[dict]) -> None:
    """``cross``: a returning turn served by another worker than the conversation's previous turn;
    ``first_visit``: a cross-worker turn on a worker that served none of the conversation's turns
    before (with private tiers it has none of the history; otherwise it has an older part)."""
    prev: dict[str, str | None] = {}
    seen: dict[str, set[str]] = {}
    for x in turns:
        # a turn whose worker is unknown (a worker that reported none) decides nothing either way
        known = x["worker"] is not None and prev.get(x["conv"]) is not None
        x["cross"] = x["turn"] > 0 and known and x["worker"] != prev[x["conv"]]
        x["first_visit"] = x["cross"] and x["worker"] not in seen.get(x["conv"], set())
        prev[x["conv"]] = x["worker"]
        seen.setdefault(x["conv"], set()).add(x["worker"])


def busiest_worker(turns: list[dict], before_turn: int) -> str | None:
    """The worker that served the most conversations' turn ``before_turn - 1`` (ties: the first seen)."""
    last = [x["worker"] for x in turns if x["turn"] == before_turn - 1 and x["worker"] is not None]
    return max(dict.fromkeys(last), key=last.count) if last else None


def mark_failover(turns: list[dict], victim: str | None, at_turn: int) -> None:
    """``failover``: turn ``at_turn`` of a conversation whose previous turn ``victim`` served (the
    first turn after that worker was lost)."""
    prev = {(x["conv"], x["turn"]): x["worker"] for x in turns}
    for x in turns:
        x["failover"] = victim is not None and x["turn"] == at_turn and prev.get((x["conv"], at_turn - 1)) == victim


def run_config(cfg: Config, convs, clients: int, worker_flags: list[str], log_dir: Path, tok) -> dict:
    disk = Path(tempfile.mkdtemp(prefix="loopkv-cluster-"))
    flags = [*worker_flags, "--loopkv-tier-disk-dir", str(disk) if cfg.shared else "none"]
    (log_dir / cfg.name).mkdir(parents=True, exist_ok=True)
    cluster = Cluster(flags, workers=cfg.workers, policy=cfg.policy, log_dir=log_dir / cfg.name)
    t_start = time.perf_counter()
    drill: dict = {}
    try:
        cluster.start()
        startup_s = time.perf_counter() - t_start
        # one warm-up turn per worker, straight to it: first-use costs off the clock (and its worker id)
        ids = [(generate_turn(p.url, "Say hello.", 4)["cached_details"] or {}).get("worker") for p in cluster.procs]
        t0 = time.perf_counter()
        k = cfg.kill_before_turn
        turns = play(cluster.url, convs, clients, tok, 0, k)
        wall = time.perf_counter() - t0
        if k is not None:
            victim = busiest_worker(turns, k)
            if victim not in ids:
                raise RuntimeError(f"turn {k - 1} was served by {victim!r}, none of the workers {ids}")
            t_kill = time.perf_counter()
            cluster.kill_worker(ids.index(victim))
            cluster.wait_healthy(cfg.workers - 1)  # the router's health checks took it out
            drill = {"victim": victim, "routed_around_s": time.perf_counter() - t_kill}
            t0 = time.perf_counter()
            turns += play(cluster.url, convs, clients, tok, k)
            wall += time.perf_counter() - t0
            mark_failover(turns, victim, k)
    finally:
        cluster.stop()
        shutil.rmtree(disk, ignore_errors=True)
    turns.sort(key=lambda x: (x["conv"], x["turn"]))
    mark_cross_worker(turns)
    return {"config": asdict(cfg), "startup_s": startup_s, "wall_s": wall, "turns": turns, **drill}


def config_summary(res: dict) -> dict:
    turns = res["turns"]
    back = [x for x in turns if x["turn"] > 0]
    cross = [x for x in back if x["cross"]]
    hits = [x for x in cross if x["storage_shared"] > 0]
    return {
        "turns": len(turns),
        "turns_per_min": 60 * len(turns) / res["wall_s"],
        "workers_used": len({x["worker"] for x in turns} - {None}),
        "turns_without_worker": sum(x["worker"] is None for x in turns),
        "ttft_p50_s": pct([x["ttft_s"] for x in turns], 0.5),
        "ttft_p90_s": pct([x["ttft_s"] for x in turns], 0.9),
        "returning_turns": len(back),
        "returning_ttft_p50_s": pct([x["ttft_s"] for x in back], 0.5),
        "cross_worker_turns": len(cross),
        "cross_worker_share": len(cross) / len(back) if back else None,
        "cross_worker_ttft_p50_s": pct([x["ttft_s"] for x in cross], 0.5),
        "cross_worker_ttft_p90_s": pct([x["ttft_s"] for x in cross], 0.9),
        "cross_worker_hit_fraction": len(hits) / len(cross) if cross else None,
        "first_visit_turns": sum(x["first_visit"] for x in cross),
        "first_visit_ttft_p50_s": pct([x["ttft_s"] for x in cross if x["first_visit"]], 0.5),
        "resumed_from_other_worker_share": len(hits) / len(back) if back else None,
        "recompute_tokens_avoided": sum(x["cached_tokens"] or 0 for x in turns),
        "recompute_tokens_avoided_shared": sum(x["storage_shared"] for x in turns),
        "mean_score": sum(x["score"] for x in turns) / len(turns),
        **failover_summary(res),
    }


def failover_summary(res: dict) -> dict:
    """The failover drill's figures of one configuration (none for a configuration without one)."""
    if "victim" not in res:
        return {}
    moved = [x for x in res["turns"] if x.get("failover")]
    return {
        "failover_turns": len(moved),
        "failover_ttft_p50_s": pct([x["ttft_s"] for x in moved], 0.5),
        "failover_hit_fraction": sum(x["storage_shared"] > 0 for x in moved) / len(moved) if moved else None,
        "failover_history_tokens_p50": pct([x["cached_tokens"] or 0 for x in moved], 0.5),
        "routed_around_s": res["routed_around_s"],
    }


def summarize_shape(results: dict) -> dict:
    """One conversation shape's summary (``results``: configuration name -> run_config's result)."""
    for res in results.values():
        mark_cross_worker(res["turns"])
    per = {name: config_summary(res) for name, res in results.items()}
    answers = {name: {(x["conv"], x["turn"]): x["answer"] for x in res["turns"]} for name, res in results.items()}
    summary: dict = {"per_config": per, "turns_per_min": {n: p["turns_per_min"] for n, p in per.items()}}
    # the two-worker pairs under the plain keys, the larger round_robin pairs' with "_3w" / "_4w" appended
    for workers, pol, x in ((2, "rr", ""), (2, "ca", ""), *((n, "rr", x) for n, x in EXTRA_RR.items())):
        shared, private = f"{workers}w-shared-{pol}", f"{workers}w-private-{pol}"
        if shared in results and private in results:
            cross = [(t["conv"], t["turn"]) for t in results[shared]["turns"] if t["cross"]]
            same = [answers[shared][k] == answers[private][k] for k in cross]
            summary[f"cross_worker_answers_identical_{pol}{x}"] = f"{sum(same)}/{len(same)}"
            summary[f"ttft_ratio_private_over_shared_{pol}{x}"] = ratio(
                per[private]["cross_worker_ttft_p50_s"], per[shared]["cross_worker_ttft_p50_s"]
            )
            summary[f"ttft_ratio_private_over_shared_{pol}_first_visit{x}"] = ratio(
                per[private]["first_visit_ttft_p50_s"], per[shared]["first_visit_ttft_p50_s"]
            )
            # Timing decides which turns change worker, so the p50s above compare different sets of
            # turns; the paired figure compares the same turns: those that changed worker in both runs.
            sh, pr = ({(t["conv"], t["turn"]): t for t in results[n]["turns"]} for n in (shared, private))
            both = [k for k in cross if k in pr and pr[k]["cross"]]
            summary[f"cross_worker_turns_paired_{pol}{x}"] = len(both)
            summary[f"ttft_ratio_private_over_shared_{pol}_paired{x}"] = ratio(
                pct([pr[k]["ttft_s"] for k in both], 0.5), pct([sh[k]["ttft_s"] for k in both], 0.5)
            )
    fo_shared, fo_private = FAILOVER_PAIR
    if fo_shared in results and fo_private in results:
        moved = [(t["conv"], t["turn"]) for t in results[fo_shared]["turns"] if t.get("failover")]
        same = [answers[fo_shared][k] == answers[fo_private].get(k) for k in moved]
        summary["failover_answers_identical"] = f"{sum(same)}/{len(same)}"
        summary["failover_hit_fraction"] = per[fo_shared]["failover_hit_fraction"]
        summary["ttft_ratio_private_over_shared_failover"] = ratio(
            per[fo_private]["failover_ttft_p50_s"], per[fo_shared]["failover_ttft_p50_s"]
        )
    for n, x in {2: "", **EXTRA_RR}.items():
        rr = per.get(f"{n}w-shared-rr", {})
        summary[f"cross_worker_hit_fraction_round_robin{x}"] = rr.get("cross_worker_hit_fraction")
        summary[f"ttft_ratio_private_over_shared_round_robin{x}"] = summary.get(f"ttft_ratio_private_over_shared_rr{x}")
    ident = summary.get("cross_worker_answers_identical_rr", "0/0").split("/")
    summary["cross_worker_resume_identical"] = ident[0] == ident[1] != "0"
    if "1w" in results and "2w-shared-rr" in results:
        keys = answers["1w"].keys() & answers["2w-shared-rr"].keys()
        summary["answers_identical_to_one_worker_rr"] = (
            f"{sum(answers['1w'][k] == answers['2w-shared-rr'][k] for k in keys)}/{len(keys)}"
        )
        summary["second_worker_turns_per_min_ratio_rr"] = ratio(
            per["2w-shared-rr"]["turns_per_min"], per["1w"]["turns_per_min"]
        )
    return summary


def summarize(results: dict, results_followup: dict | None = None) -> dict:
    """The LoopServe-style shape's summary under its keys, the follow-up shape's under the same keys
    with ``_followup`` appended (``per_config_followup``, ``ttft_ratio_private_over_shared_rr_followup``...)."""
    summary = summarize_shape(results)
    if results_followup:
        summary |= {f"{k}_followup": v for k, v in summarize_shape(results_followup).items()}
    return summary


def verdict(v, target: float) -> str:
    return "-" if v is None else "met" if v >= target else "not met"


def fmt(v, digits: int = 2):
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def shape_table(per: dict) -> str:
    rows = []
    for name, q in per.items():
        rows.append(
            [
                name,
                fmt(q["turns_per_min"], 1),
                f"{fmt(q['ttft_p50_s'])} / {fmt(q['ttft_p90_s'])}",
                f"{q['cross_worker_turns']}/{q['returning_turns']}",
                f"{fmt(q['cross_worker_ttft_p50_s'])} / {fmt(q['cross_worker_ttft_p90_s'])}",
                f"{q['first_visit_turns']}: {fmt(q['first_visit_ttft_p50_s'])}",
                fmt(q["cross_worker_hit_fraction"]),
                q["recompute_tokens_avoided"],
                q["recompute_tokens_avoided_shared"],
            ]
        )
    return md_table(
        [
            "config",
            "turns/min",
            "TTFT p50 / p90 s",
            "cross-worker / returning turns",
            "cross-worker TTFT p50 / p90 s",
            "of which first visits: TTFT p50 s",
            "cross-worker resumed from the shared tier",
            "cached tokens (recompute avoided)",
            "of which stored by the other worker",
        ],
        rows,
    )


def rr_line(s: dict, x: str = "") -> str:
    """The round_robin verdicts of one shape (``x``: the summary keys' suffix), two workers then more."""
    lines = []
    for n, w in (("two", ""), ("three", "_3w"), ("four", "_4w")):
        hit = s.get(f"cross_worker_hit_fraction_round_robin{w}{x}")
        r = s.get(f"ttft_ratio_private_over_shared_round_robin{w}{x}")
        if hit is None and r is None:
            continue
        lines.append(
            f"round_robin, {n} workers: {fmt(hit)} of the cross-worker turns resumed from the shared tier "
            f"(target >= 0.9: {verdict(hit, 0.9)}); their TTFT p50 private / shared = {fmt(r)}x (target >= 3x: "
            f"{verdict(r, 3.0)}); over the {s.get(f'cross_worker_turns_paired_rr{w}{x}', '-')} turns that changed worker "
            f"in both runs {fmt(s.get(f'ttft_ratio_private_over_shared_rr_paired{w}{x}'))}x; "
            f"{fmt(s.get(f'ttft_ratio_private_over_shared_rr_first_visit{w}{x}'))}x for those "
            f"on a worker that had served none of the conversation before; answers of those turns identical to "
            f"the private run's (recomputed): {s.get(f'cross_worker_answers_identical_rr{w}{x}', '-')}."
        )
    one = s.get(f"answers_identical_to_one_worker_rr{x}")
    return "\n\n".join(lines) + (f" All answers (two workers, shared) vs one worker: {one}." if one else "")


def failover_line(s: dict, x: str = "") -> str:
    """The failover drill's verdict of one shape (``x``: the summary keys' suffix); empty without one."""
    if f"ttft_ratio_private_over_shared_failover{x}" not in s:
        return ""
    per = s[f"per_config{x}"]
    sh, pr = (per[n] for n in FAILOVER_PAIR)
    return (
        f"\n\nFailover (`cache_aware`, `kill -9` of the busier worker before turn {FAILOVER_TURN}; the router took "
        f"{fmt(sh['routed_around_s'], 1)} / {fmt(pr['routed_around_s'], 1)} s to route around it): "
        f"{sh['failover_turns']} / {pr['failover_turns']} conversations moved to the survivor "
        f"(history p50 {int(sh['failover_history_tokens_p50'] or 0)} tokens cached, shared); "
        f"{fmt(s[f'failover_hit_fraction{x}'])} of them resumed from the shared tier; their TTFT p50 private / shared = "
        f"{fmt(pr['failover_ttft_p50_s'])} / {fmt(sh['failover_ttft_p50_s'])} s = "
        f"**{fmt(s[f'ttft_ratio_private_over_shared_failover{x}'])}x**; answers identical to the recomputed ones: "
        f"{s[f'failover_answers_identical{x}']}."
    )


def report_md(p: dict) -> str:
    s, cfg = p["summary"], p["config"]
    env = p["env"]
    text = (
        f"# cluster ({env['when']}; `python -m benchmarks.cluster{cfg['argv']}`; {cfg['model']}, "
        f"{cfg['n_convs']} conversations / {cfg['n_turns']} turns, {cfg['clients']} clients at once; "
        f"{env['cpu_count']} cores; load avg {load1(env['loadavg_start']):.1f} -> {load1(env['loadavg_end']):.1f}; "
        f"{env['wall_s'] / 60:.1f} min wall)\n\n"
    )
    if s["per_config"]:
        text += (
            "## LoopServe-style shape (benchmarks/conversations.py: each turn brings new context and its "
            "question)\n\n" + shape_table(s["per_config"])
        )
        ca = (
            "\n\ncache_aware: "
            + (
                f"TTFT ratio {fmt(s['ttft_ratio_private_over_shared_ca'])}x"
                if s.get("ttft_ratio_private_over_shared_ca") is not None
                else "no returning turn changed worker"
            )
            + ". "
            if "2w-shared-ca" in s["per_config"]
            else "\n\n"
        )
        second = s.get("second_worker_turns_per_min_ratio_rr")  # needs the 1w run
        text += (
            f"\n{rr_line(s)}{ca}"
            + (f"A second worker on the same 2 cores: {fmt(second)}x the turns/min of one." if second else "")
            + failover_line(s)
            + "\n"
        )
    if s.get("per_config_followup"):
        text += (
            "\n## Follow-up shape (the same conversations: all context in the first turn, every later turn its "
            "question alone)\n\n"
            + shape_table(s["per_config_followup"])
            + f"\n{rr_line(s, '_followup')}"
            + failover_line(s, "_followup")
            + "\n"
        )
    return text


def plot(p: dict, path: Path) -> None:
    s = p["summary"]
    shapes = [
        (title, per)
        for title, per in (
            ("LoopServe-style", s["per_config"]),
            ("follow-up", s.get("per_config_followup") or {}),
        )
        if per
    ]
    with figure(path, len(shapes), 2, size=(12, 4.2 * len(shapes)), squeeze=False) as (fig, axes):
        _bars(fig, axes, shapes)


def _bars(fig, axes, shapes) -> None:
    bars = (
        ("ttft_p50_s", "all turns"),
        ("cross_worker_ttft_p50_s", "cross-worker turns"),
        ("first_visit_ttft_p50_s", "of which first visits"),
        ("failover_ttft_p50_s", "failover turns (worker killed)"),
    )
    for row, (title, per) in zip(axes, shapes):
        names = list(per)
        row[0].bar(names, [per[n]["turns_per_min"] for n in names], color="C0")
        row[0].set(ylabel="turns / min", title=f"{title} shape: throughput")
        x = range(len(names))
        for k, (key, label) in enumerate(bars):
            row[1].bar([i + 0.2 * k for i in x], [per[n].get(key) or 0 for n in names], width=0.2, label=label)
        row[1].set_xticks([i + 0.3 for i in x], names)
        row[1].set(ylabel="TTFT p50 (s)", title=f"{title} shape: time to first token")
        row[1].legend(fontsize=8)
        for ax in row:
            ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle("sgl-loopkv workers behind sglang-router: shared vs private tiers")


def run(args, env: dict) -> dict:
    from transformers import AutoTokenizer

    model_dir = Path(args.model_path) if args.model_path else ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    convs = conv.suite(conv.TASKS, args.convs_per_task, args.lengths, tuple(args.turns), args.seed, count)
    played = {"loopserve": convs, "followup": [followup(c) for c in convs]}
    todo = [
        (shape, c)
        for shape in args.shapes
        for c in CONFIGS
        if c.name in (args.configs if shape == "loopserve" else args.followup_configs)
    ]
    worker_flags = ["--max-total-tokens", str(args.max_total_tokens)]
    if args.model_path:
        worker_flags += ["--model-path", str(model_dir)]
    else:  # the float32 conversion: what the committed results measured (a plain start serves the GGUF file)
        worker_flags += ["--loopkv-weights", "float32"]
    log_dir = Path(tempfile.mkdtemp(prefix="loopkv-cluster-logs-"))
    results: dict[str, dict] = {shape: {} for shape in SHAPES}
    for shape, cfg in todo:
        print(f"[cluster] {shape} {cfg.name}: {cfg.what}", flush=True)
        res = run_config(cfg, played[shape], args.clients, worker_flags, log_dir / shape, tok)
        results[shape][cfg.name] = res
        print(f"[cluster] {shape} {cfg.name}: {config_summary(res)}", flush=True)
    argv = " ".join(sys.argv[1:])
    return {
        "summary": summarize(results["loopserve"], results["followup"]),
        "config": {
            "argv": f" {argv}" if argv else "",
            "model": model_dir.name,
            "n_convs": len(convs),
            "n_turns": sum(len(c.turns) for c in convs),
            "shapes": args.shapes,
            "followup_configs": args.followup_configs if "followup" in args.shapes else [],
            "clients": args.clients,
            "lengths": args.lengths,
            "turns": args.turns,
            "convs_per_task": args.convs_per_task,
            "max_total_tokens": args.max_total_tokens,
            "seed": args.seed,
            "logs": str(log_dir),
        },
        "results": results["loopserve"],  # the LoopServe-style shape
        "results_followup": results["followup"],
    }


def refresh(p: dict) -> None:
    p["summary"] = summarize(p["results"], p.get("results_followup"))


BENCH = cli.Benchmark("cluster", run, report_md, plot, refresh)


def main() -> None:
    ap = cli.parser(BENCH, __doc__)
    ap.add_argument("--convs-per-task", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[3072, 4096], help="conversation lengths (tokens)")
    ap.add_argument("--turns", type=int, nargs=2, default=[5, 6], help="turns per conversation (min max)")
    ap.add_argument("--clients", type=int, default=2, help="conversations played at once")
    names = [c.name for c in CONFIGS]
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help="conversation shapes to play")
    default = [n for n in names if n not in OPT_IN]
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=names,
        default=default,
        help=f"configurations, LoopServe-style shape (opt-in: {' '.join(OPT_IN)})",
    )
    ap.add_argument(
        "--followup-configs",
        nargs="+",
        choices=names,
        default=list(FOLLOWUP_CONFIGS),
        help="configurations, follow-up shape",
    )
    ap.add_argument("--model-path", help="a local model folder (default: the embedded SmolLM2)")
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="each worker's KV pool")
    ap.add_argument("--seed", type=int, default=0)
    cli.main(BENCH, ap)


if __name__ == "__main__":
    main()
