"""The servers a test session shares, started ahead of the tests that use them.

A server start is ~30 s of mostly one busy core (imports, then the model and warm-up), and the
default suite needs several. So at the session's first test, :class:`SessionServers` starts every
shared server that the selected tests use, in the order of their first use, ``IN_FLIGHT`` at a time,
in a background thread, while the in-process tests run (tests/conftest.py runs them first): a test
that needs a server finds it started or starting. All of them stop together at the session's end.
A server is built by a function of :class:`SessionPaths` registered under its fixture's name
(tests/e2e/conftest.py); ``get`` waits for it (or starts it, if nothing did)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sgl_loopkv.server.process import ServerProcess

IN_FLIGHT = 2  # two starts together take ~1.4x one: more would only slow the tests beside them
READY_TIMEOUT_S = 900


@dataclass(frozen=True)
class SessionPaths:
    """What the shared servers are built from, made once per session."""

    default_model_dir: Path
    tiny_model_dir: Path
    logs: Path
    standin_trace: Path
    keyed_disk_dir: Path


def make_paths(tmp_path_factory) -> SessionPaths:
    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import ensure_default_model

    default = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    return SessionPaths(
        default_model_dir=default,
        tiny_model_dir=_tiny_model(default, tmp_path_factory.mktemp("tiny-llama")),
        logs=tmp_path_factory.mktemp("server-logs"),
        standin_trace=tmp_path_factory.mktemp("trace") / "sgl_kernel_standin.trace",
        keyed_disk_dir=tmp_path_factory.mktemp("keyed-disk"),
    )


def _tiny_model(default_model_dir: Path, out: Path) -> Path:
    """A 2-layer random-weight Llama (GQA 4:2) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer

    from tests.fakes import tiny_llama

    model = tiny_llama(
        2,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties under fp noise
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(out)
    return out


@dataclass
class _Slot:
    build: Callable[[SessionPaths], ServerProcess]
    server: ServerProcess | None = None
    done: threading.Event = field(default_factory=threading.Event)  # ready, or failed with ``error``
    error: BaseException | None = None


class SessionServers:
    """Shared servers by fixture name: registered, started ahead (:meth:`prestart`), handed out
    (:meth:`get`), stopped together (:meth:`stop_all`)."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._paths: SessionPaths | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # The environment every shared server starts from, taken before any test runs: the in-process
        # tests that run while servers start may set variables (LOOPKV_CONFIG makes a plain
        # sglang.launch_server act as one of our launcher's) and a server must not inherit them.
        self._env: dict[str, str] | None = None

    def register(self, name: str) -> Callable:
        def deco(build: Callable[[SessionPaths], ServerProcess]):
            self._slots[name] = _Slot(build)
            return build

        return deco

    def doc(self, name: str) -> str | None:
        return self._slots[name].build.__doc__

    @property
    def names(self) -> set[str]:
        return set(self._slots)

    def prestart(self, paths: SessionPaths, names: list[str]) -> None:
        """Start ``names`` (registered ones, in this order) in the background."""
        self._paths = paths
        self._env = self._env or dict(os.environ)
        todo = [n for n in names if n in self._slots]
        if todo:
            self._thread = threading.Thread(target=self._start_in_order, args=(todo,), daemon=True)
            self._thread.start()

    def _start_in_order(self, names: list[str]) -> None:
        pending = list(names)
        waiting: list[threading.Thread] = []
        while pending or waiting:
            while pending and len(waiting) < IN_FLIGHT:
                name = pending.pop(0)
                if (w := self._spawn(name)) is not None:
                    waiting.append(w)
            if waiting:
                waiting.pop(0).join()  # the oldest start is done: the next may begin

    def _spawn(self, name: str) -> threading.Thread | None:
        """Spawn ``name``'s server unless done already; a thread waits for it to be ready."""
        slot = self._slots[name]
        with self._lock:
            if slot.server is not None:
                return None
            try:
                server = slot.build(self._paths)
                server.base_env = self._env if server.base_env is None else server.base_env
                slot.server = server.spawn()
            except BaseException as e:
                slot.error = e
                slot.done.set()
                return None
        t = threading.Thread(target=self._wait, args=(slot,), daemon=True)
        t.start()
        return t

    @staticmethod
    def _wait(slot: _Slot) -> None:
        try:
            slot.server.wait_ready(READY_TIMEOUT_S)
        except BaseException as e:
            slot.error = e
        finally:
            slot.done.set()

    def get(self, name: str, paths: SessionPaths) -> ServerProcess:
        """The started server of ``name`` (started now if no prestart did)."""
        self._paths = self._paths or paths
        self._env = self._env or dict(os.environ)
        slot = self._slots[name]
        if (w := self._spawn(name)) is not None:
            w.join()
        slot.done.wait()
        if slot.error is not None:
            raise RuntimeError(f"the shared server {name} did not start") from slot.error
        return slot.server

    def stop_all(self) -> None:
        """Stop every server at once: SIGTERM to all, then each is waited for (and killed if it lingers)."""
        servers = [s.server for s in self._slots.values() if s.server is not None]
        for srv in servers:
            if srv.proc is not None and srv.proc.poll() is None:
                try:
                    os.killpg(srv.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for srv in servers:
            srv.stop()


SERVERS = SessionServers()
