"""Settings shared by tests/unit and tests/e2e: the report header, the rule that every test using a
server carries the ``server`` marker (``-m "not server"`` must start none), and a count of the server
processes the session started, with their start-up seconds, at the end of the report (the suite's
time is mostly start-ups: share a server where a test can), and the shared servers started ahead of
their tests while the in-process tests run first (tests/servers.py)."""

from __future__ import annotations

import os
import time

import pytest

from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.server.process import ServerProcess
from tests.servers import SERVERS, SessionPaths, make_paths

#: fixtures that start a server process of a test module's own; the shared ones are ``SERVERS.names``
OWN_SERVER_FIXTURES = {"faults_server", "gguf_server"}


def pytest_collection_modifyitems(config, items):
    # in-process tests first: the shared servers start meanwhile (a stable sort keeps each group's order)
    items.sort(key=lambda i: i.get_closest_marker("server") is not None)
    starting = OWN_SERVER_FIXTURES | SERVERS.names
    unmarked = [i.nodeid for i in items if starting & set(i.fixturenames) and not i.get_closest_marker("server")]
    if unmarked:
        raise pytest.UsageError(f"tests that start a server must carry @pytest.mark.server: {unmarked}")


def pytest_report_header(config):
    return f"sgl-loopkv cache dir: {LoopKVConfig().resolved_cache_dir}; torch threads: {os.cpu_count()}"


STARTS: list[tuple[str, float]] = []  # (log file name or module, seconds from spawn to ready)


@pytest.fixture(scope="session", autouse=True)
def _count_server_starts():
    spawn, wait_ready = ServerProcess.spawn, ServerProcess.wait_ready

    def timed_spawn(self):
        self._spawned_at = time.monotonic()
        return spawn(self)

    def timed_wait_ready(self, timeout_s):
        wait_ready(self, timeout_s)
        name = self.log_path.name if self.log_path else self.module
        STARTS.append((name, time.monotonic() - getattr(self, "_spawned_at", time.monotonic())))

    ServerProcess.spawn, ServerProcess.wait_ready = timed_spawn, timed_wait_ready
    yield
    ServerProcess.spawn, ServerProcess.wait_ready = spawn, wait_ready


def pytest_terminal_summary(terminalreporter):
    if STARTS:
        slowest = ", ".join(f"{n} {s:.0f} s" for n, s in sorted(STARTS, key=lambda x: -x[1])[:5])
        terminalreporter.write_line(
            f"server starts: {len(STARTS)}, {sum(s for _, s in STARTS):.0f} s spawn-to-ready in all (slowest: {slowest})"
        )


@pytest.fixture(scope="session")
def session_paths(tmp_path_factory) -> SessionPaths:
    """The models, log and disk directories the shared servers are built from."""
    return make_paths(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _shared_servers(request, _count_server_starts):
    """At the first test: start the shared servers the selected tests use, in the order of first use;
    at the end: stop them all at once."""
    order = [n for item in request.session.items for n in item.fixturenames if n in SERVERS.names]
    names = list(dict.fromkeys(order))
    if names:
        SERVERS.prestart(request.getfixturevalue("session_paths"), names)
    yield
    SERVERS.stop_all()


@pytest.fixture
def impress_registered(monkeypatch):
    """The IMPRESS-style baseline (``benchmarks/baselines/impress.py``) registered as a chunk selection
    for this test only, as ``LOOPKV_EXTENSIONS`` registers it in a benchmark's server (afterwards the
    registry holds the package's names again: a page generated from the flags never lists it)."""
    from sgl_loopkv.cache.chunk_selection import CHUNK_SELECTIONS

    monkeypatch.setattr(CHUNK_SELECTIONS, "_factories", dict(CHUNK_SELECTIONS._factories))
    from benchmarks.baselines.impress import NAME, ImpressSelection

    CHUNK_SELECTIONS.register(NAME)(ImpressSelection)
    return ImpressSelection
