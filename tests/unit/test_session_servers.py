"""The test suite's shared-server registry (tests/servers.py): what a server starts from."""

from __future__ import annotations

import os

from server.process import ServerProcess
from tests.servers import SessionServers


class _Spawned(ServerProcess):
    def spawn(self) -> ServerProcess:  # records what a real spawn would start from, starts nothing
        self.started_from = dict(os.environ if self.base_env is None else self.base_env)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        pass


def test_a_shared_server_starts_from_the_environment_before_the_tests(monkeypatch):
    """In-process tests run while the shared servers start and may set variables (``LOOPKV_CONFIG``
    turns a plain ``sglang.launch_server`` into one that acts as our launcher's): a server must not
    inherit what a test set after the session began."""
    servers = SessionServers()
    servers.register("late")(lambda paths: _Spawned(["--model-path", "m"]))
    monkeypatch.delenv("LOOPKV_CONFIG", raising=False)
    servers.prestart(paths=None, names=[])  # the session begins: nothing to start ahead
    monkeypatch.setenv("LOOPKV_CONFIG", "{}")  # a test running meanwhile
    started = servers.get("late", paths=None)
    assert "LOOPKV_CONFIG" not in started.started_from
    assert started.started_from.get("PATH") == os.environ.get("PATH")


def test_a_servers_own_variables_are_added_to_its_base_environment(monkeypatch):
    seen = {}
    monkeypatch.setattr("server.process.subprocess.Popen", lambda cmd, env, **kw: seen.update(env) or object())
    ServerProcess(["--model-path", "m"], module="x", env={"A": "1"}, base_env={"A": "0", "B": "2"}).spawn()
    assert seen == {"A": "1", "B": "2"}
