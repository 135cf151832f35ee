"""``python -m sgl_loopkv.launch_server``: real SGLang's server with the sgl-loopkv plugin loaded.

Every ``sglang.launch_server`` flag passes through unchanged. sgl-loopkv adds its ``--loopkv-*``
flags, the embedded default model when no ``--model-path`` is given, and device defaults that a
flag on the command line always overrides:

- CPU (no GPU visible): SGLang's CPU engine, the ``loopkv`` attention backend, float32
  (``--dtype bfloat16`` is opt-in, see ``platform.default_cpu_dtype``), no overlap schedule /
  CUDA graphs, ``--sleep-on-idle`` (else the idle scheduler busy-polls a core), a 32K-token KV
  pool.
- GPU: SGLang's own defaults (the loopkv GPU attention path is not built yet).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.models import sglang_archs
from sgl_loopkv.platform import activate_cpu_standin, default_cpu_dtype, has_cuda, use_cpu_engine

CPU_DEFAULTS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "loopkv",
    "--radix-cache-backend": "loopkv",
    "--page-size": "16",  # = the tiered cache's chunk: node boundaries are chunk boundaries
    "--max-total-tokens": "32768",  # SGLang would size the pool from all host RAM otherwise
    "--disable-overlap-schedule": None,
    "--disable-cuda-graph": None,
    "--sleep-on-idle": None,
    "--enable-cache-report": None,
}
# --loopkv-stock: SGLang's own CPU configuration (what sgl-loopkv is measured against), same dtype.
STOCK_CPU_DEFAULTS = {k: v for k, v in CPU_DEFAULTS.items() if k not in ("--radix-cache-backend", "--page-size")}
STOCK_CPU_DEFAULTS["--attention-backend"] = "torch_native"


def cpu_defaults(stock: bool) -> dict[str, str | None]:
    """The CPU defaults; stock mode gets the same dtype as sgl-loopkv."""
    return {**(STOCK_CPU_DEFAULTS if stock else CPU_DEFAULTS), "--dtype": default_cpu_dtype()}


# SGLang's own attention and radix cache on a GPU until a GPU run shows the tiered cache working there.
GPU_DEFAULTS: dict[str, str | None] = {
    "--enable-cache-report": None,
}


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_defaults(argv: list[str], defaults: dict[str, str | None]) -> list[str]:
    """Append each default flag the user did not pass (``None`` = a boolean switch)."""
    out = list(argv)
    for flag, value in defaults.items():
        if not _given(argv, flag):
            out += [flag] if value is None else [flag, value]
    return out


def loopkv_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_loopkv.launch_server",
        add_help=add_help,
        description="SGLang server with sgl-loopkv. All sglang.launch_server flags are accepted; "
        "without --model-path the embedded SmolLM2-135M-Instruct is served.",
    )
    LoopKVConfig.add_cli_args(parser)
    return parser


def build_sglang_argv(argv: list[str]) -> tuple[LoopKVConfig, list[str], bool]:
    """Split argv into sgl-loopkv's config and SGLang's argv (with defaults and the model filled
    in). Sets up this process for the chosen device. Returns (config, sglang argv, on_gpu)."""
    ns, rest = loopkv_parser(add_help=False).parse_known_args(argv)
    config = LoopKVConfig.from_cli_args(ns)
    if not config.stock:  # before SGLang is imported here or in a subprocess: see sglang_archs
        os.environ.setdefault(sglang_archs.ENV, sglang_archs.PACKAGE)
    on_gpu = config.device == "cuda" or (config.device == "auto" and has_cuda())
    if not on_gpu:
        use_cpu_engine()
    config.to_env()
    activate_cpu_standin()
    if not _given(rest, "--model-path") and not {"-h", "--help"} & set(rest):
        from sgl_loopkv.models import DEFAULT_MODEL_NAME, ensure_default_model

        rest = ["--model-path", str(ensure_default_model(config.resolved_cache_dir))] + rest
        if not _given(rest, "--served-model-name"):
            rest += ["--served-model-name", DEFAULT_MODEL_NAME]
    if on_gpu:
        defaults = {"--enable-cache-report": None} if config.stock else GPU_DEFAULTS
    else:
        defaults = cpu_defaults(config.stock)
    return config, with_defaults(rest, defaults), on_gpu


def refuse_a_taken_port(host: str, port: int) -> None:
    """Exit at once with a readable error when ``host:port`` cannot be bound. SGLang finds out only
    after loading the model, and then its HTTP server stops while its scheduler lives on: the
    process never exits, and a launcher waiting for it waits for its whole timeout."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT leftover is fine
            s.bind(addr)
    except OSError as e:
        raise SystemExit(
            f"sgl-loopkv: cannot serve on {host}:{port}: {e.strerror or e} (another process uses it? choose --port)"
        ) from None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        loopkv_parser(add_help=False).print_help()
        print("\nSGLang's own flags follow (all accepted unchanged):\n")
    config, sglang_argv, _ = build_sglang_argv(argv)

    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sgl_loopkv.plugin import register
    from sgl_loopkv.server.forget import install_route
    from sgl_loopkv.server.limits import install_http_limits
    from sgl_loopkv.server.redact import redact_server_args
    from sgl_loopkv.server.rendezvous import private_rendezvous

    load_plugins()  # our entry point and any other installed plugin, as sglang.launch_server does
    register()  # idempotent; keeps loopkv available even if SGLANG_PLUGINS filters entry points
    server_args = prepare_server_args(sglang_argv)
    refuse_a_taken_port(server_args.host, server_args.port)
    redact_server_args(server_args)  # /server_info shows the command line: no keys in it
    # Only the one-tokenizer app: with --tokenizer-worker-num > 1 uvicorn workers import a fresh app.
    install_http_limits(app, config.limits)
    install_route(app)  # POST /loopkv/forget
    try:
        with private_rendezvous(server_args):  # no scheduler socket on every interface
            run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
