"""Soak: sgl-loopkv next to stock SGLang under a sustained multi-turn load on loopback (issue 16).

Load: ``--conversations`` clients (32) at once over the OpenAI chat API (streaming, greedy,
``--max-tokens`` per answer), each playing conversations back to back: a conversation is
``--turns`` turns of about ``--user-tokens`` new user tokens each (benchmarks/conversations.py,
task and seed fixed by client and round), and every turn's history holds the server's *own*
earlier answers, so histories grow as in a real chat. When a client finishes a conversation it
starts its next one; at ``--duration`` no client starts another turn and the turns in flight
finish (drain). Both systems get the same clients and conversation sequence: what differs is how
many turns each completes (turns/min counts those finished within the duration).

Server: the embedded SmolLM2-135M in the launcher's dtype, a device pool of ``--pool`` tokens
(far below the 32 live histories); sgl-loopkv with a host tier of ``--host-tokens`` and a disk
tier of ``--disk-tokens`` (bytes = tokens x the model's KV bytes per token; the disk tier in a
fresh temp dir), stock SGLang (``--loopkv-stock``) with the same pool and nothing else. Before the
soak, a warm-up (one request as long as the longest prompt the load sends, then turn 0 of one
extra conversation per client, all at once) and ``/flush_cache``.

Sampled every ``--sample-s`` seconds: the server's RSS (summed over its process tree), the bytes
under the disk-tier dir (segment files, in-flight temp files included: what ``--loopkv-disk-bytes``
bounds; and the whole dir with its index and lock), the host tier's bytes (``/metrics``), turns
done. Per turn: TTFT, TPOT, cached tokens per tier. Bounds (``*_within_quota``, every sample):
disk segment bytes <= ``--loopkv-disk-bytes``; host tier bytes <= ``--loopkv-host-bytes``; RSS <=
reference + host quota + 2 x pool bytes. Reference = what the load itself needs: the larger of the
tree's RSS after the warm-up and flush (baseline: model, pool, and the forward's buffers unless the
server handed them back) and stock SGLang's peak RSS under the same load in the same run (sgl-loopkv
trims the C heap at a flush and every few seconds, so its baseline leaves out buffers the load takes
again). 2 x pool bytes = KV between tiers in flight: at most a pool's worth (restores are bounded by
the device slots they fill), plus the raw buffer of the disk read being decoded.

Answers identical: every completed turn again on a fresh server of the same flags, one request at
a time in conversation order, with the history as recorded in the soak; each greedy answer must
equal the soak's. Stock SGLang's turns get the same check (``--no-stock-replay`` skips it), which
tells a mismatch of ours from one of SGLang's batched CPU path. A mismatch is probed on the
reference server: teacher forced to the answers' common token prefix, its top-2 next tokens and
their logprob margin (a near-tie that fp rounding can flip has a small margin and the two answers'
tokens as its top two).

    python -m benchmarks.soak --quick     # 2 minutes of load per system
    python -m benchmarks.soak             # 10 minutes per system
    python -m benchmarks.soak --duration 90 --systems loopkv --loopkv-args "--loopkv-restore-planner load_all" \\
        --out soak_ab                     # an A/B of one sgl-loopkv flag
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from benchmarks import conversations as conv
from benchmarks.common import chat_turn, cpu_pool_dtype, model_facts, synthetic_ids, tier_bytes, timed_generate
from benchmarks.harness import cli
from benchmarks.harness.plot import figure
from benchmarks.harness.results import RESULTS, md_table
from benchmarks.harness.stats import percentile
from sgl_loopkv.server.process import ServerProcess

# name -> launcher flags. sgl-loopkv on the float32 conversion: what the committed results measured (a plain
# start serves the GGUF file); --loopkv-stock always serves it
SYSTEMS = {"loopkv": ("--loopkv-weights", "float32"), "stock": ("--loopkv-stock",)}


@dataclass(frozen=True)
class Load:
    """What the clients send; the same for every system of a run."""

    conversations: int = 32  # clients at once
    turns: int = 6  # per conversation
    user_tokens: int = 200  # new user text per turn (about)
    max_tokens: int = 24  # per answer (greedy; EOS may end it sooner)
    seed: int = 0


@dataclass(frozen=True)
class Tiers:
    """Device pool and tier quotas in tokens of KV; bytes via the model's KV bytes per token."""

    pool: int = 4096
    host_tokens: int = 4096
    disk_tokens: int = 16384


# --- the conversations ------------------------------------------------------------------------
@functools.cache
def conversation(load: Load, client: int, rnd: int, count: Callable[[str], int]) -> conv.Conversation:
    """Round ``rnd`` of ``client``: deterministic by (seed, client, round); tasks cycle."""
    task = conv.TASKS[(client + rnd) % len(conv.TASKS)]
    seed = load.seed * 1_000_000 + client * 1000 + rnd
    return conv.generate(task, seed, load.turns, load.turns * (load.user_tokens + 60), count)


def turn_messages(c: conv.Conversation, answers: list[str]) -> list[dict]:
    """The chat of turn ``len(answers)`` of ``c``: the earlier turns carry the recorded answers."""
    msgs = [{"role": "system", "content": conv.SYSTEM_PROMPT}]
    for turn, answer in zip(c.turns, answers):
        msgs += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": c.turns[len(answers)].user}]


def longest_prompt(load: Load, tok, count) -> int:
    """Tokens of the longest prompt the load can send (last turn, every answer ``max_tokens`` long),
    over every client's first round (a later round's lengths are drawn the same way)."""
    out = 0
    for client in range(load.conversations):
        c = conversation(load, client, 0, count)
        filler = " ".join(["word"] * load.max_tokens)
        msgs = turn_messages(c, [filler] * (len(c.turns) - 1))
        out = max(out, len(prompt_ids(tok, msgs)))
    return out


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """The token ids SGLang's chat endpoint prefills for ``messages`` (the model's chat template)."""
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]


# --- sampling ---------------------------------------------------------------------------------
def tree_rss(srv: ServerProcess) -> int:
    """RSS summed over the server's process tree (shared pages count once per process: an upper bound)."""
    import psutil

    total = 0
    for pid in srv.pids():
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def dir_bytes(root: Path) -> tuple[int, int]:
    """(segment-file bytes incl. their in-flight temp files, all bytes) under ``root`` (st_size), each
    file once: a chunk's entry under ``chunks/`` is a hard link to its segment file (counted per link,
    the 2026-11-27 run's directory "peaked at 67602 MB" beside 755 MB of segments)."""
    seg = total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                st = os.stat(os.path.join(dirpath, f))
            except FileNotFoundError:  # deleted or renamed under us
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            if f.startswith("seg_"):
                seg += st.st_size
    return seg, total


class Sampler(threading.Thread):
    """Every ``interval_s`` until :meth:`stop`: one sample of RSS, disk, host tier and progress."""

    def __init__(self, srv: ServerProcess, disk: Path, interval_s: float, progress: Callable[[], int]):
        super().__init__(daemon=True)
        self.srv, self.disk, self.interval_s, self.progress = srv, disk, interval_s, progress
        self.samples: list[dict] = []
        self._stop_evt = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        seg, total = dir_bytes(self.disk)
        self.samples.append(
            {
                "t": time.monotonic() - self.t0,
                "rss_bytes": tree_rss(self.srv),
                "disk_bytes": seg,
                "disk_dir_bytes": total,
                "host_tier_bytes": tier_bytes(self.srv.url).get("host"),
                "turns": self.progress(),
            }
        )

    def run(self) -> None:
        while not self._stop_evt.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()
        self.sample()


# --- the load ---------------------------------------------------------------------------------
async def play(url: str, load: Load, duration_s: float, count, t0: float, turns: list, errors: list) -> float:
    """Every client plays conversations until ``duration_s`` after ``t0`` (monotonic); appends
    each completed turn to ``turns`` and each failed one to ``errors``. Returns the drain time."""
    loop = asyncio.get_running_loop()
    deadline = t0 + duration_s
    pool = ThreadPoolExecutor(load.conversations)  # one blocking streaming client per conversation

    async def client(k: int) -> None:
        rnd = 0
        while time.monotonic() < deadline:
            c, answers = conversation(load, k, rnd, count), []
            for t in range(len(c.turns)):
                if time.monotonic() >= deadline:
                    break
                start = time.monotonic() - t0
                try:
                    r = await loop.run_in_executor(
                        pool, chat_turn, url, turn_messages(c, answers), load.max_tokens, "sglang"
                    )
                except Exception as e:  # an error ends this conversation; the client starts its next
                    errors.append({"client": k, "round": rnd, "turn": t, "t": start, "error": repr(e)[:500]})
                    await asyncio.sleep(1)  # a dead server must not turn into a busy loop of errors
                    break
                answers.append(r["answer"])
                turns.append(
                    {
                        "client": k,
                        "round": rnd,
                        "turn": t,
                        "task": c.task,
                        "start_s": start,
                        "end_s": time.monotonic() - t0,
                        **{key: r[key] for key in ("ttft_s", "tpot_s", "completion_tokens", "cached_tokens")},
                        "cached_details": r["cached_details"],
                        "answer": r["answer"],
                    }
                )
            rnd += 1

    try:
        await asyncio.gather(*(client(k) for k in range(load.conversations)))
    finally:
        pool.shutdown(wait=False)
    return max(0.0, time.monotonic() - deadline)


def by_conversation(turns: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """(client, round) -> its completed turns in order (always turns 0..n-1: a failed turn ends it)."""
    out = defaultdict(list)
    for x in sorted(turns, key=lambda x: (x["client"], x["round"], x["turn"])):
        out[(x["client"], x["round"])].append(x)
    return out


def replay(url: str, load: Load, turns: list[dict], tok, count) -> dict:
    """Every recorded turn again, one request at a time, with the recorded history; the answers
    compared with the soak's, and each mismatch probed for its logprob margin."""
    compared, mismatches, errors = 0, [], []
    t0 = time.monotonic()
    for (k, rnd), rows in by_conversation(turns).items():
        c = conversation(load, k, rnd, count)
        answers = [x["answer"] for x in rows]
        for x in rows:
            msgs = turn_messages(c, answers[: x["turn"]])
            try:
                ref = chat_turn(url, msgs, load.max_tokens, "sglang")["answer"]
            except Exception as e:
                errors.append({"client": k, "round": rnd, "turn": x["turn"], "error": repr(e)[:500]})
                continue
            compared += 1
            if ref != x["answer"]:
                mismatches.append(
                    {"client": k, "round": rnd, "turn": x["turn"], "reference": ref, "soak": x["answer"]}
                    | margin_probe(url, prompt_ids(tok, msgs), tok, x["answer"], ref)
                )
    return {"compared": compared, "mismatches": mismatches, "errors": errors, "wall_s": time.monotonic() - t0}


def margin_probe(url: str, prompt: list[int], tok, soak: str, ref: str) -> dict:
    """Where two greedy answers to ``prompt`` part: the server's top-2 next tokens after their common
    token prefix (teacher forced, one request) and the top-1 minus top-2 logprob there. A near-tie
    (small margin, the two answers' tokens the top two) is what fp rounding can flip; a large
    margin, or a token outside the top two, is not."""
    ids_s, ids_r = (tok(x, add_special_tokens=False)["input_ids"] for x in (soak, ref))
    k = next((i for i, (a, b) in enumerate(zip(ids_s, ids_r)) if a != b), min(len(ids_s), len(ids_r)))
    body = {
        "input_ids": prompt + ids_r[:k],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    try:
        r = requests.post(f"{url}/generate", json=body, timeout=900)
        r.raise_for_status()
        top = r.json()["meta_info"]["output_top_logprobs"][0]  # [(logprob, token id, text)] best first
    except (requests.RequestException, KeyError, IndexError, ValueError) as e:
        return {"diverge_token": k, "probe_error": repr(e)[:300]}
    nxt = lambda ids: ids[k] if k < len(ids) else None  # noqa: E731  (None: that answer ended there)
    return {
        "diverge_token": k,
        "margin": top[0][0] - top[1][0] if len(top) > 1 else None,
        "top2_ids": [t[1] for t in top],
        "reference_next_id": nxt(ids_r),
        "soak_next_id": nxt(ids_s),
        "near_tie_pair": {nxt(ids_r), nxt(ids_s)} == {t[1] for t in top[:2]},
    }


# --- one system -------------------------------------------------------------------------------
def run_system(
    name: str,
    flags: list[str],
    load: Load,
    tiers: Tiers,
    duration_s: float,
    tok,
    kv_bytes_per_token: int,
    *,
    check_answers: bool,
    tiered: bool = True,
    sample_s: float = 2.0,
    rss_slack_bytes: int = 0,
    log_path: Path | None = None,
    progress: Callable[[str], None] = lambda msg: print(msg, flush=True),
) -> dict:
    """Start the server, warm it up, take the RSS baseline, soak, drain, optionally replay; stop it.

    ``flags``: launcher flags besides the pool and tiers (``--loopkv-stock``, ``--model-path``, ...);
    ``tiered``: the server gets the host and disk quotas (False: stock SGLang, no tiers to bound).
    ``rss_slack_bytes``: added to the RSS bound, for a model whose pool and host quota are too small
    to absorb the Python heap's own drift (the tiny test model: ~1 MB of quotas)."""
    count = functools.cache(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]))
    host_bytes = tiers.host_tokens * kv_bytes_per_token if tiered else 0
    disk_quota = tiers.disk_tokens * kv_bytes_per_token if tiered else 0
    pool_bytes = tiers.pool * kv_bytes_per_token
    disk = Path(tempfile.mkdtemp(prefix=f"loopkv-soak-{name}-"))
    tier_flags = (
        ["--loopkv-tier-host-bytes", str(host_bytes), "--loopkv-tier-disk-bytes", str(disk_quota)] if tiered else []
    )
    # ``flags`` last: a flag given twice takes its last value, so an A/B flag overrides the tiers' own
    args = ["--max-total-tokens", str(tiers.pool), "--enable-metrics", *tier_flags]
    srv = ServerProcess([*args, "--loopkv-tier-disk-dir", str(disk), *flags], log_path=log_path)
    turns, errors = [], []
    out = {"name": name, "flags": [*args, *flags]}
    try:
        srv.start()
        out["startup_s"] = srv.startup_s
        longest = longest_prompt(load, tok, count)
        progress(f"[soak] {name}: warm-up (one {longest}-token prompt, then one turn of every client at once)")
        warm_up(srv.url, load, count, min(longest, tiers.pool - load.max_tokens - 16), tok)
        time.sleep(1)
        baseline = tree_rss(srv)
        log_at = log_path.stat().st_size if log_path else 0
        sampler = Sampler(srv, disk, sample_s, lambda: len(turns))
        sampler.sample()
        sampler.start()
        progress(f"[soak] {name}: {load.conversations} clients for {duration_s:.0f} s")
        drain = asyncio.run(play(srv.url, load, duration_s, count, sampler.t0, turns, errors))
        sampler.stop()
        out["server_tracebacks"] = log_tracebacks(log_path, log_at) if log_path else None
    finally:
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)
    if check_answers:  # a fresh server (and disk dir): nothing of the soak's state carries over
        ref_log = log_path.with_name(log_path.stem + "_replay.log") if log_path else None
        with ServerProcess([*args, *flags], log_path=ref_log) as ref:
            progress(f"[soak] {name}: replaying {len(turns)} turns one at a time on a fresh server")
            out["replay"] = replay(ref.url, load, turns, tok, count)
        out["replay"]["server_tracebacks"] = log_tracebacks(ref_log, 0) if ref_log else None
    out |= {
        "duration_s": duration_s,
        "drain_s": drain,
        "longest_prompt_tokens": longest,
        "rss_baseline_bytes": baseline,
        "rss_slack_bytes": rss_slack_bytes,
        "rss_quota_bytes": baseline + host_bytes + 2 * pool_bytes + rss_slack_bytes,
        "pool_bytes": pool_bytes,
        "host_quota_bytes": host_bytes,
        "disk_quota_bytes": disk_quota,
        "samples": sampler.samples,
        "turns": turns,
        "errors": errors,
    }
    return out


def warm_up(url: str, load: Load, count, prompt_tokens: int, tok) -> None:
    """What the RSS baseline must include besides the tiers: the largest single prefill (the longest
    prompt) and the load's concurrency (turn 0 of a conversation per client, all at once; round -1,
    which the soak never plays). Ends with every tier flushed."""
    timed_generate(url, synthetic_ids(tok, prompt_tokens, 1), load.max_tokens)
    with ThreadPoolExecutor(load.conversations) as ex:
        msgs = [turn_messages(conversation(load, k, -1, count), []) for k in range(load.conversations)]
        list(ex.map(lambda m: chat_turn(url, m, load.max_tokens, "sglang"), msgs))
    flush(url)


def flush(url: str) -> None:
    """``/flush_cache`` once nothing runs (SGLang refuses while requests are pending)."""
    for _ in range(60):
        if requests.post(f"{url}/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(1)
    raise RuntimeError("the server did not flush its cache within a minute")


def log_tracebacks(path: Path, offset: int) -> int:
    """Tracebacks the server logged after ``offset`` (after start-up: import noise excluded)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().count(b"Traceback (most recent call last)")


# --- summary and report -----------------------------------------------------------------------
def system_summary(res: dict, rss_reference: int | None = None) -> dict:
    """The per-system figures of the summary (a system's result from :func:`run_system`).

    ``rss_reference``: the RSS that the server's own load needs, when known better than this
    system's baseline (stock SGLang's peak under the same load: sgl-loopkv trims the C heap after
    the warm-up, so its baseline leaves out the forward's buffers that the load then takes again)."""
    done = [x for x in res["turns"] if x["end_s"] <= res["duration_s"]]
    ttft = [x["ttft_s"] for x in res["turns"]]
    tpot = [x["tpot_s"] for x in res["turns"] if x["tpot_s"]]
    samples = res["samples"]
    host = [s["host_tier_bytes"] for s in samples if s["host_tier_bytes"] is not None]
    tiers = Counter()
    for x in res["turns"]:
        for k, v in (x["cached_details"] or {}).items():
            if isinstance(v, int):
                tiers[k] += v
    rp = res.get("replay")
    errors = len(res["errors"]) + (res["server_tracebacks"] or 0)
    errors += (len(rp["errors"]) + (rp["server_tracebacks"] or 0)) if rp else 0
    max_rss, max_disk = max(s["rss_bytes"] for s in samples), max(s["disk_bytes"] for s in samples)
    reference = max(rss_reference or 0, res["rss_baseline_bytes"])
    bound = reference + res["host_quota_bytes"] + 2 * res["pool_bytes"] + res["rss_slack_bytes"]
    out = {
        "errors": errors,
        "failed_turns": len(res["errors"]),
        "failed_replay_turns": len(rp["errors"]) if rp else None,
        "server_tracebacks": res["server_tracebacks"],
        "turns": len(res["turns"]),
        "conversations_started": len({(x["client"], x["round"]) for x in res["turns"]}),
        "turns_per_min": 60 * len(done) / res["duration_s"],
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        # by turn index: a system that finishes more turns finishes more late ones, whose longer
        # histories wait longer, so its overall TTFT median can be worse while every turn is faster
        "ttft_p50_by_turn_s": {
            t: percentile([x["ttft_s"] for x in res["turns"] if x["turn"] == t], 50)
            for t in sorted({x["turn"] for x in res["turns"]})
        },
        "turns_by_turn": dict(sorted(Counter(x["turn"] for x in res["turns"]).items())),
        "cached_tokens_by_tier": dict(tiers),
        "max_rss_bytes": max_rss,
        "rss_baseline_bytes": res["rss_baseline_bytes"],
        "rss_reference_bytes": reference,
        "rss_quota_bytes": bound,
        "rss_within_quota": max_rss <= bound,
        "max_disk_bytes": max_disk,
        # None: not measured right (a run before hard links were counted once)
        "max_disk_dir_bytes": max(
            (s["disk_dir_bytes"] for s in samples if s["disk_dir_bytes"] is not None), default=None
        ),
        "disk_quota_bytes": res["disk_quota_bytes"],
        "disk_within_quota": max_disk <= res["disk_quota_bytes"],
        "max_host_tier_bytes": max(host) if host else None,
        "host_quota_bytes": res["host_quota_bytes"],
        "host_within_quota": (max(host) <= res["host_quota_bytes"]) if host else None,
        "samples": len(samples),
        "drain_s": res["drain_s"],
        "startup_s": res["startup_s"],
    }
    if rp:
        out |= {
            "answers_compared": rp["compared"],
            "answers_identical": not rp["mismatches"] and rp["compared"] == len(res["turns"]),
            "answers_identical_fraction": 1 - len(rp["mismatches"]) / rp["compared"] if rp["compared"] else None,
            "mismatches": len(rp["mismatches"]),
            "replay_s": rp["wall_s"],
        }
    return out


def summarize(results: dict, load: Load) -> dict:
    main = "loopkv" if "loopkv" in results else next(iter(results))  # a stock-only run: stock's figures
    st = system_summary(results["stock"]) if "stock" in results and main != "stock" else None
    lk = system_summary(results[main], st and st["max_rss_bytes"])
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    out = {
        "errors": lk["errors"],
        "conversations": load.conversations,
        "duration_s": results[main]["duration_s"],
        "answers_identical": lk.get("answers_identical"),
        "answers_identical_fraction": lk.get("answers_identical_fraction"),
        "mismatches": lk.get("mismatches"),
        "turns": lk["turns"],
        "turns_per_min": lk["turns_per_min"],
        "max_rss_bytes": lk["max_rss_bytes"],
        "rss_quota_bytes": lk["rss_quota_bytes"],
        "rss_within_quota": lk["rss_within_quota"],
        "max_disk_bytes": lk["max_disk_bytes"],
        "disk_quota_bytes": lk["disk_quota_bytes"],
        "disk_within_quota": lk["disk_within_quota"],
        "max_host_tier_bytes": lk["max_host_tier_bytes"],
        "host_quota_bytes": lk["host_quota_bytes"],
        "ttft_p50_s": lk["ttft_p50_s"],
        "ttft_p99_s": lk["ttft_p99_s"],
        "tpot_p50_s": lk["tpot_p50_s"],
        "tpot_p99_s": lk["tpot_p99_s"],
        "turns_per_min_ratio_vs_stock": ratio(lk["turns_per_min"], st and st["turns_per_min"]),
        # the same check on stock SGLang: is a mismatch ours or the batched CPU path's?
        "stock_answers_identical_fraction": st and st.get("answers_identical_fraction"),
        # stock / loopkv: > 1 means sgl-loopkv is faster
        "ttft_p50_ratio_stock_over_loopkv": ratio(st and st["ttft_p50_s"], lk["ttft_p50_s"]),
        "ttft_p99_ratio_stock_over_loopkv": ratio(st and st["ttft_p99_s"], lk["ttft_p99_s"]),
        "ttft_p50_by_turn_ratio_stock_over_loopkv": st
        and {t: ratio(st["ttft_p50_by_turn_s"].get(t), v) for t, v in lk["ttft_p50_by_turn_s"].items()},
        "rss_baseline_ratio_loopkv_over_stock": ratio(lk["rss_baseline_bytes"], st and st["rss_baseline_bytes"]),
        "startup_ratio_loopkv_over_stock": ratio(lk["startup_s"], st and st["startup_s"]),
        "tpot_p50_ratio_stock_over_loopkv": ratio(st and st["tpot_p50_s"], lk["tpot_p50_s"]),
        "system": main,
        "per_system": {main: lk, **({"stock": st} if st else {})},
    }
    return out


def report_md(p: dict) -> str:
    sm, cfg, env = p["summary"], p["config"], p["env"]
    mb = lambda v: "-" if v is None else f"{v / 1e6:.0f}"  # noqa: E731
    ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
    rows = []
    for name, s in sm["per_system"].items():
        c = s["cached_tokens_by_tier"]
        rows.append(
            [
                name,
                s["turns"],
                s["turns_per_min"],
                s["errors"],
                s["ttft_p50_s"],
                s["ttft_p99_s"],
                ms(s["tpot_p50_s"]),
                ms(s["tpot_p99_s"]),
                f"{s['startup_s']:.1f}",
                mb(s["rss_baseline_bytes"]),
                f"{mb(s['max_rss_bytes'])} / {mb(s['rss_quota_bytes'])}",
                f"{mb(s['max_host_tier_bytes'])} / {mb(s['host_quota_bytes'])}" if s["host_quota_bytes"] else "-",
                f"{mb(s['max_disk_bytes'])} / {mb(s['disk_quota_bytes'])}" if s["disk_quota_bytes"] else "-",
                "/".join(str(c.get(k, 0)) for k in ("device", "host", "storage")) if "device" in c else "-",
                f"{s['answers_compared'] - s['mismatches']}/{s['answers_compared']}"
                if "answers_compared" in s
                else "-",
            ]
        )
    load, tiers = cfg["load"], cfg["tiers"]
    head = (
        f"# soak ({env['when']}, {cfg['mode']}: {load['conversations']} concurrent conversations of "
        f"{load['turns']} turns x ~{load['user_tokens']} new tokens, <= {load['max_tokens']} answer tokens, "
        f"{sm['duration_s']:.0f} s of load per system; device pool {tiers['pool']} tokens, host tier "
        f"{tiers['host_tokens']} tokens, disk tier {tiers['disk_tokens']} tokens ({cfg['model']}, "
        f"{cfg['dtype']}); load avg {env['loadavg_start']:.1f} -> {env['loadavg_end']:.1f})\n\n"
    )
    t = md_table(
        [
            "system",
            "turns",
            "turns/min",
            "errors",
            "TTFT p50 s",
            "TTFT p99 s",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "start-up s",
            "RSS after warm-up MB",
            "max RSS / bound MB",
            "max host tier / quota MB",
            "max disk / quota MB",
            "cached tokens device/host/disk",
            "answers identical one at a time",
        ],
        rows,
    )
    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lk = sm["per_system"][sm.get("system", "loopkv")]
    text = (
        head
        + t
        + f"\nturns/min sgl-loopkv / stock: **{f2(sm['turns_per_min_ratio_vs_stock'])}**; TTFT stock / sgl-loopkv: "
        f"p50 {f2(sm['ttft_p50_ratio_stock_over_loopkv'])}, p99 {f2(sm['ttft_p99_ratio_stock_over_loopkv'])}; "
        f"TPOT p50 stock / sgl-loopkv {f2(sm['tpot_p50_ratio_stock_over_loopkv'])}.\n\n"
        f"{sm.get('system', 'loopkv')} answers identical to the same turns played one at a time: "
        f"**{sm['answers_identical']}**"
        + (
            f" (stock SGLang: {f2(sm['stock_answers_identical_fraction'])} of its turns identical). "
            if sm.get("stock_answers_identical_fraction") is not None
            else ". "
        )
        + f"Within bounds throughout ({lk['samples']} samples, every {cfg['sample_s']:.0f} s): "
        f"RSS {lk['rss_within_quota']}, host tier {lk['host_within_quota']}, disk {lk['disk_within_quota']}.\n\n"
        "RSS = sum over the server's process tree; bound = reference + host quota + 2 x pool bytes, where "
        "reference = the larger of the RSS after start-up + warm-up + `/flush_cache` (baseline) and stock "
        "SGLang's peak RSS under the same load in the same run (what the load itself needs), and 2 x pool "
        "bytes = KV between tiers in flight (at most a pool's worth, plus the raw buffer of the disk read "
        "being decoded). Disk = segment files under the disk-tier dir (temp files of "
        "writes in flight included); the dir with its index, lock and chunk links peaked at "
        + (
            f"{mb(lk['max_disk_dir_bytes'])} MB"
            if lk["max_disk_dir_bytes"] is not None
            else "(not measured in this run)"
        )
        + ". Turns/min counts turns finished within the duration; TTFT and "
        "TPOT cover every turn.\n"
    )
    # int keys: the summary is always recomputed from the results before a report (--report-only too)
    turns = sorted({t for s in sm["per_system"].values() for t in s["ttft_p50_by_turn_s"]})
    text += "\nTTFT p50 s by turn index (turns finished; a later turn carries a longer history):\n\n" + md_table(
        ["system", *(f"turn {t}" for t in turns)],
        [
            [
                name,
                *(
                    f"{s['ttft_p50_by_turn_s'][t]:.1f} ({s['turns_by_turn'][t]})"
                    if t in s["ttft_p50_by_turn_s"]
                    else "-"
                    for t in turns
                ),
            ]
            for name, s in sm["per_system"].items()
        ],
    )
    for name, res in p["results"].items():
        mism = (res.get("replay") or {}).get("mismatches", [])
        if not mism:
            continue
        text += (
            f"\n{name}: mismatches (reference = one at a time; margin = top-1 minus top-2 logprob after the "
            "answers' common token prefix, teacher forced on the same server):\n\n"
        )
        text += md_table(
            ["conversation", "turn", "diverging token", "margin (nats)", "the answers' tokens are the top 2"],
            [
                [
                    f"{m['client']}/{m['round']}",
                    m["turn"],
                    m.get("diverge_token"),
                    m.get("margin"),
                    m.get("near_tie_pair"),
                ]
                for m in mism
            ],
        )
    return text


def plot(p: dict, path: Path) -> None:
    with figure(path, 1, 3, size=(14, 4.2)) as (fig, axes):
        _plot(p, fig, axes)


def _plot(p: dict, fig, axes) -> None:
    for i, (name, res) in enumerate(p["results"].items()):
        s = res["samples"]
        t = [x["t"] for x in s]
        col = f"C{i}"
        axes[0].plot(t, [x["rss_bytes"] / 1e6 for x in s], color=col, label=name)
        axes[0].axhline(res["rss_quota_bytes"] / 1e6, color=col, ls="--", lw=1, label=f"{name} bound")
        axes[1].plot(t, [x["disk_bytes"] / 1e6 for x in s], color=col, label=f"{name} disk")
        if res["host_quota_bytes"]:
            axes[1].plot(t, [(x["host_tier_bytes"] or 0) / 1e6 for x in s], color=col, ls=":", label=f"{name} host")
            axes[1].axhline(res["disk_quota_bytes"] / 1e6, color=col, ls="--", lw=1, label=f"{name} disk quota")
            axes[1].axhline(res["host_quota_bytes"] / 1e6, color=col, ls="-.", lw=1, label=f"{name} host quota")
        ends = sorted(x["end_s"] for x in res["turns"])
        axes[2].step(ends, range(1, len(ends) + 1), where="post", color=col, label=name)
    axes[0].set(xlabel="s", ylabel="MB", title="server RSS (process tree)")
    axes[1].set(xlabel="s", ylabel="MB", title="tier bytes")
    axes[2].set(xlabel="s", ylabel="turns", title="turns completed")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"Soak: {p['config']['load']['conversations']} concurrent conversations")


def refresh(p: dict) -> None:
    p["summary"] = summarize(p["results"], Load(**p["config"]["load"]))


def run(args, env: dict) -> dict:
    from transformers import AutoTokenizer

    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import ensure_default_model

    duration = args.duration or (120.0 if args.quick else 600.0)
    load = Load(args.conversations, args.turns, args.user_tokens, args.max_tokens, args.seed)
    tiers = Tiers(args.pool, args.host_tokens, args.disk_tokens)
    model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype, dtype_bytes = cpu_pool_dtype()
    facts = model_facts(model_dir)
    kv = facts.kv_bytes_per_token(dtype_bytes)
    results = {}
    for name in args.systems:
        flags = SYSTEMS[name]
        extra = args.loopkv_args.split() if name == "loopkv" else []
        results[name] = run_system(
            name,
            [*flags, *extra],
            load,
            tiers,
            duration,
            tok,
            kv,
            check_answers=name == "loopkv" or not args.no_stock_replay,
            tiered=name == "loopkv",
            sample_s=args.sample_s,
            log_path=RESULTS / f"{args.out}_{name}.log",
        )
    return {
        "summary": summarize(results, load),
        "config": {
            "mode": "quick" if args.quick else "full",
            "out": args.out,
            "loopkv_args": args.loopkv_args,
            "load": asdict(load),
            "tiers": asdict(tiers),
            "sample_s": args.sample_s,
            "model": facts.name,
            "dtype": dtype,
            "kv_bytes_per_token": kv,
        },
        "results": results,
    }


BENCH = cli.Benchmark("soak", run, report_md, plot, refresh)


def main() -> None:
    ap = cli.parser(BENCH, __doc__)
    ap.add_argument("--quick", action="store_true", help="2 minutes per system (CI)")
    ap.add_argument("--duration", type=float, help="seconds of load per system (default 600, --quick 120)")
    ap.add_argument("--conversations", type=int, default=Load.conversations)
    ap.add_argument("--turns", type=int, default=Load.turns)
    ap.add_argument("--user-tokens", type=int, default=Load.user_tokens)
    ap.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    ap.add_argument("--pool", type=int, default=Tiers.pool)
    ap.add_argument("--host-tokens", type=int, default=Tiers.host_tokens)
    ap.add_argument("--disk-tokens", type=int, default=Tiers.disk_tokens)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--no-stock-replay", action="store_true", help="replay sgl-loopkv's turns only")
    ap.add_argument("--loopkv-args", default="", help="extra launcher flags of the sgl-loopkv server (A/B runs)")
    cli.main(BENCH, ap)


if __name__ == "__main__":
    main()
