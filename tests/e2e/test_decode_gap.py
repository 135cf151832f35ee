"""A disk resume does not hold up the requests that are running (issue 54, point 3).

One conversation decodes while another, whose history only the disk tier holds (no host arena, the
segment files dropped from the page cache), comes back. With ``--loopkv-tier-disk-read background`` (the
default) the history is read and verified on the read-ahead thread while its request sits out the
scheduler's rounds (the server's ``held`` stage says it was), at background priority and paced
(:mod:`sgl_loopkv.cache.read_pacing`: it naps between pieces while others run), and every decode step
of the running stream in that window should stay within 1.5x of the stream's median inter-token gap.
On 2 cores some resumes have met that and most do not (the study's latest run: none of three, and the
stream's own largest gap with no read beside it already ~1.3-1.7x its median), so the check is an
expected failure that may pass. The one step that
holds the returning turn's own prefill (its new tokens' extend, and on a CPU the copy of its history
into the pool before that forward) is excluded: stock SGLang runs that prefill in the same place,
recomputing the whole history. The control (``-m slow``) reads inline, on the scheduler thread: the
read then sits inside that step, which grows past 1.5x the background server's (the test can fail).

The model is a random-weight Llama whose KV is large beside its compute (16 layers, 8 KV heads of
64): 2,000 history tokens are 131 MB of float32 KV, a read of ~0.1-0.5 s on the machines here,
against decode steps of a few tens of milliseconds. The scenario is ``benchmarks.studies.decode_gap``'s,
which measures it repeatedly, paced and not."""

from __future__ import annotations

import pytest

from benchmarks.common import metrics
from benchmarks.studies.decode_gap import BOUND, HISTORY, decode_beside_disk_resume, disk_only_args, kv_heavy_model
from sgl_loopkv.server.process import ServerProcess
from tests.servers import SERVERS, SessionPaths

pytestmark = pytest.mark.server


def _disk_dir(p: SessionPaths, read: str):
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


HELD = 'loopkv_restore_seconds_total{part="held"}'
_BACKGROUND: list = []  # the default-suite test's window, for the control


@pytest.mark.slow  # a server of its own beside the default suite's
@pytest.mark.xfail(
    strict=False,
    reason="on 2 cores an odd decode step beside the paced read-ahead still goes past the bound "
    "(benchmarks/results/studies/decode_gap.md; "
    "docs/decisions/2026-12-06-read-ahead-paced.md)",
)
def test_a_disk_resume_does_not_hold_up_a_running_decode(disk_only_server, session_paths):
    held = metrics(disk_only_server.url).get(HELD, 0.0)
    w = decode_beside_disk_resume(disk_only_server.url, _disk_dir(session_paths, "background"), seed=0)
    _BACKGROUND.append(w)
    assert w.cached.get("storage", 0) >= HISTORY // 16 * 16 - 16, w.cached  # it came back from disk
    assert metrics(disk_only_server.url).get(HELD, 0.0) > held, "the request was not held while its history was read"
    disk = {k: round(v, 3) for k, v in metrics(disk_only_server.url).items() if k.startswith("loopkv_disk_seconds")}
    assert w.beside_resume(), "no decode step ran while the history was read: " + w.report()
    assert max(w.beside_resume()) <= BOUND * w.median, w.report() + f" disk: {disk}"


@pytest.mark.slow
def test_control_an_inline_disk_read_holds_up_the_decode(disk_only_server, session_paths):
    """The same with ``--loopkv-tier-disk-read inline``: the read runs inside the scheduler's prefix match,
    in the returning turn's prefill step, which the running stream waits for (the measurement can fail)."""
    if not _BACKGROUND:
        _BACKGROUND.append(decode_beside_disk_resume(disk_only_server.url, _disk_dir(session_paths, "background"), 0))
    model = kv_heavy_model(session_paths.logs.parent / "kv-heavy-llama", session_paths.default_model_dir)
    disk = _disk_dir(session_paths, "inline")
    with ServerProcess(disk_only_args(model, disk, "inline"), log_path=session_paths.logs / "disk-inline.log") as srv:
        w = decode_beside_disk_resume(srv.url, disk, seed=10)
    assert w.cached.get("storage", 0) > 0, w.cached
    background = _BACKGROUND[-1]
    assert w.prefill_step() > BOUND * background.prefill_step(), w.report() + " | background: " + background.report()
