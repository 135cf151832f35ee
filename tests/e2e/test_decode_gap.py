"""A disk resume does not hold up the requests that are running (issue 54, point 3).

One conversation decodes while another, whose history only the disk tier holds (no host arena, the
segment files dropped from the page cache), comes back. With ``--loopkv-disk-read background`` (the
default) the history is read and verified on the read-ahead thread while its request sits out the
scheduler's rounds (the server's ``held`` stage says it was), at background priority and paced
(:mod:`sgl_loopkv.cache.read_pacing`: it naps between pieces while others run), so every decode step
of the running stream in that window stays within 1.5x of the stream's median inter-token gap
(``LOOPKV_READ_AHEAD_PACED=0``, niced but not paced, fails the bound on 2 cores). The one step that
holds the returning turn's own prefill (its new tokens' extend, and on a CPU the copy of its history
into the pool before that forward) is excluded: stock SGLang runs that prefill in the same place,
recomputing the whole history. The control (``-m slow``) reads inline, on the scheduler thread: the
read then sits inside that step, which grows past 1.5x the background server's (the test can fail).

The model is a random-weight Llama whose KV is large beside its compute (16 layers, 8 KV heads of
64): 2,000 history tokens are 131 MB of float32 KV, a read of ~0.1-0.5 s on the machines here,
against decode steps of a few tens of milliseconds."""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from benchmarks.common import drop_page_cache, metrics
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS
from tests.servers import SERVERS, SessionPaths

pytestmark = pytest.mark.server

BOUND = 1.5  # a decode step beside a disk resume / the stream's median step
HISTORY, FILLER, STREAM_PROMPT, NEW, STREAM_TOKENS = 2000, 2600, 64, 16, 240
BASELINE_STEPS = 60  # the stream's gaps before the resume is sent: its median


def kv_heavy_model(out: Path, tokenizer_dir: Path) -> Path:
    """A random Llama with SmolLM2's tokenizer whose KV per token (64 KiB float32) dwarfs its weights."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    from tests.fakes import tiny_llama

    geometry = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    model = tiny_llama(16, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True, **geometry)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def disk_only_args(model: Path, disk: Path, read: str) -> list[str]:
    """A pool of ~2 histories, no host arena: an evicted history lives on disk only."""
    pool = ["--max-total-tokens", "4096", *COMMON_SERVER_ARGS[2:]]
    return ["--model-path", str(model), *pool, "--loopkv-host-bytes", "0", "--loopkv-disk-dir", str(disk),
            "--loopkv-disk-read", read, "--enable-metrics"]  # fmt: skip


def _disk_dir(p: SessionPaths, read: str) -> Path:
    d = p.logs.parent / f"disk-only-{read}"
    d.mkdir(exist_ok=True)
    return d


@SERVERS.register("disk_only_server")
def _disk_only(p: SessionPaths) -> ServerProcess:
    """The KV-heavy random Llama with a disk tier and no host arena, disk reads in the background."""
    model = kv_heavy_model(p.logs.parent / "kv-heavy-llama", p.default_model_dir)
    return ServerProcess(
        disk_only_args(model, _disk_dir(p, "background"), "background"), log_path=p.logs / "disk-only.log"
    )


@pytest.fixture(scope="session")
def disk_only_server(session_paths: SessionPaths) -> ServerProcess:
    return SERVERS.get("disk_only_server", session_paths)


@dataclass
class Window:
    """The running stream's inter-token gaps (s) and where the returning turn sat among them."""

    gaps: list[tuple[float, float, float]]  # (gap, previous token's arrival, this token's arrival)
    sent: float  # the returning turn was sent
    first: float  # its first token arrived
    cached: dict

    def before(self) -> list[float]:
        return [g for g, _, end in self.gaps if end < self.sent]

    @property
    def median(self) -> float:
        return statistics.median(self.before())

    def beside_resume(self) -> list[float]:
        """Gaps that overlap the resume, except the step that holds its prefill."""
        return [g for g, a, b in self.gaps if b > self.sent and a < self.first and not a < self.first <= b]

    def prefill_step(self) -> float:
        return next(g for g, a, b in self.gaps if a < self.first <= b)


def _ids(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(url: str, ids: list[int], n: int, stream: bool = False):
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    r = requests.post(f"{url}/generate", json=body, timeout=600, stream=stream)
    assert r.status_code == 200, r.text
    return r


def decode_beside_disk_resume(url: str, disk: Path, seed: int) -> Window:
    """Store a history, evict it to disk (a filler), drop its pages, then resume it while another
    request streams; returns the stream's gaps around the resume."""
    history = _ids(HISTORY, seed)
    _generate(url, history, 1).json()
    time.sleep(1.0)  # the turn's write-through runs after its answer
    _generate(url, _ids(FILLER, seed + 1), 1).json()  # evicts the history from the device pool
    time.sleep(1.0)
    drop_page_cache(disk)
    arrivals: list[float] = []

    def stream() -> None:
        with _generate(url, _ids(STREAM_PROMPT, seed + 2), STREAM_TOKENS, stream=True) as r:
            for line in r.iter_lines():
                if line and line != b"data: [DONE]":
                    arrivals.append(time.perf_counter())

    th = threading.Thread(target=stream)
    th.start()
    deadline = time.monotonic() + 300
    while len(arrivals) < BASELINE_STEPS and th.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    sent, first, last = time.perf_counter(), None, None
    with _generate(url, history + _ids(NEW, seed + 3), 1, stream=True) as r:
        for line in r.iter_lines():
            if line and line != b"data: [DONE]":
                first = first or time.perf_counter()
                last = json.loads(line[len(b"data: ") :])
    th.join(timeout=600)
    assert len(arrivals) > STREAM_TOKENS // 2 and first is not None  # a chunk may carry two tokens
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:])]
    assert first < arrivals[-1], "the stream ended before the resume: nothing was measured beside it"
    return Window(gaps, sent, first, last["meta_info"].get("cached_tokens_details") or {})


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def _report(w: Window) -> str:
    return (
        f"median step {w.median * 1e3:.1f} ms (before the resume: p90 {_p90(w.before()) * 1e3:.1f}, max "
        f"{max(w.before()) * 1e3:.1f}); beside the resume (ms): "
        f"{[round(g * 1e3, 1) for g in w.beside_resume()]}; its prefill step {w.prefill_step() * 1e3:.1f} ms; "
        f"resume TTFT {(w.first - w.sent) * 1e3:.0f} ms; cached {w.cached}"
    )


HELD = 'loopkv_restore_seconds_total{part="held"}'
_BACKGROUND: list[Window] = []  # the default-suite test's window, for the control


@pytest.mark.slow  # a server of its own beside the default suite's
def test_a_disk_resume_does_not_hold_up_a_running_decode(disk_only_server, session_paths):
    held = metrics(disk_only_server.url).get(HELD, 0.0)
    w = decode_beside_disk_resume(disk_only_server.url, _disk_dir(session_paths, "background"), seed=0)
    _BACKGROUND.append(w)
    assert w.cached.get("storage", 0) >= HISTORY // 16 * 16 - 16, w.cached  # it came back from disk
    assert metrics(disk_only_server.url).get(HELD, 0.0) > held, "the request was not held while its history was read"
    disk = {k: round(v, 3) for k, v in metrics(disk_only_server.url).items() if k.startswith("loopkv_disk_seconds")}
    assert w.beside_resume(), "no decode step ran while the history was read: " + _report(w)
    assert max(w.beside_resume()) <= BOUND * w.median, _report(w) + f" disk: {disk}"


@pytest.mark.slow
def test_control_an_inline_disk_read_holds_up_the_decode(disk_only_server, session_paths):
    """The same with ``--loopkv-disk-read inline``: the read runs inside the scheduler's prefix match,
    in the returning turn's prefill step, which the running stream waits for (the measurement can fail)."""
    if not _BACKGROUND:
        _BACKGROUND.append(decode_beside_disk_resume(disk_only_server.url, _disk_dir(session_paths, "background"), 0))
    model = kv_heavy_model(session_paths.logs.parent / "kv-heavy-llama", session_paths.default_model_dir)
    disk = _disk_dir(session_paths, "inline")
    with ServerProcess(disk_only_args(model, disk, "inline"), log_path=session_paths.logs / "disk-inline.log") as srv:
        w = decode_beside_disk_resume(srv.url, disk, seed=10)
    assert w.cached.get("storage", 0) > 0, w.cached
    background = _BACKGROUND[-1]
    assert w.prefill_step() > BOUND * background.prefill_step(), _report(w) + " | background: " + _report(background)
