"""``python -m sgl_loopkv.launch_server``: real SGLang's server with the sgl-loopkv plugin loaded.

Every other ``sglang.launch_server`` flag passes through unchanged. sgl-loopkv adds its ``--loopkv-*``
flags, the embedded default model when no ``--model-path`` is given, and device defaults that a
flag on the command line always overrides:

- No ``--model-path``: the embedded default model; on the CPU its GGUF file, served from the blocks
  like any GGUF ``--model-path`` (over a bfloat16 KV pool); with ``--loopkv-weights float32``,
  ``--loopkv-stock`` or on a GPU its float32 conversion, what stock SGLang serves.
- CPU (no GPU visible): SGLang's CPU engine, the ``loopkv`` attention backend, float32
  (``--dtype bfloat16`` is opt-in, see ``platform.default_cpu_dtype``), no overlap schedule /
  CUDA graphs, ``--sleep-on-idle`` (else the idle scheduler busy-polls a core), a 32K-token KV
  pool.
- GPU: SGLang's own defaults; loopkv attention and the tiered cache are opt-in there until the GPU
  check (``benchmarks/gpu_server.sh``, docs/gpu.md) has passed on a GPU.

One flag is sized, not passed through: under a paged cache (``--page-size`` > 1) ``--max-total-tokens``
gets the page rounding SGLang's scheduler charges a request (:mod:`sgl_loopkv.server.pool_size`), so a
request gets the answer the same flag gives it from stock SGLang.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import textwrap

from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.flags import BYTES_HELP
from sgl_loopkv.models import DEFAULT_MODEL_NAME, sglang_archs
from sgl_loopkv.platform import activate_cpu_standin, default_cpu_dtype, has_cuda, use_cpu_engine
from sgl_loopkv.server.pool_size import with_page_headroom

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


# SGLang's own attention and radix cache on a GPU: loopkv's (--attention-backend loopkv --radix-cache-backend
# loopkv --page-size 16) stay opt-in on CUDA until benchmarks/gpu_server.sh has passed on a GPU (docs/gpu.md).
GPU_DEFAULTS: dict[str, str | None] = {
    "--enable-cache-report": None,
}


def _given(argv: list[str], flag: str) -> bool:
    """``flag`` is in ``argv``, under any of its names (a renamed ``--loopkv-*`` flag's old one too)."""
    return any(a == f or a.startswith(f + "=") for f in LoopKVConfig.spellings(flag) for a in argv)


def _value(argv: list[str], flag: str) -> str:
    """The value of ``flag`` (``--flag v`` or ``--flag=v``; the last one wins, as argparse)."""
    value = ""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def with_defaults(argv: list[str], defaults: dict[str, str | None]) -> list[str]:
    """Append each default flag the user did not pass (``None`` = a boolean switch)."""
    out = list(argv)
    for flag, value in defaults.items():
        if not _given(argv, flag):
            out += [flag] if value is None else [flag, value]
    return out


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, without breaking a line inside a flag name (``--loopkv-prefix-`` / ``stream``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )


def loopkv_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_loopkv.launch_server",
        usage="%(prog)s [--loopkv-FLAG VALUE ...] [sglang.launch_server flags ...]",
        add_help=add_help,
        formatter_class=_HelpFormatter,
        description="SGLang server with sgl-loopkv. All sglang.launch_server flags are accepted; "
        f"without --model-path the embedded {DEFAULT_MODEL_NAME} is served. {BYTES_HELP}",
    )
    LoopKVConfig.add_cli_args(parser)
    return parser


def sglang_defaults() -> dict[str, tuple[str | None, str | None, str | None]]:
    """Each SGLang flag the launcher sets when it is not given -> its value on CPU, on CPU with
    ``--loopkv-stock`` and on a GPU (None: not set there; ``""``: a switch that is set)."""
    cpu, stock = cpu_defaults(False), cpu_defaults(True)
    gguf = (
        f"the embedded {DEFAULT_MODEL_NAME}'s GGUF file, from its blocks over --kv-cache-dtype bf16 "
        "(--loopkv-weights float32: as with --loopkv-stock)"
    )
    converted = f"the embedded {DEFAULT_MODEL_NAME} converted to float32 (into --loopkv-cache-dir)"
    out = {"--model-path": (gguf, converted, converted), "--served-model-name": (DEFAULT_MODEL_NAME,) * 3}
    for flag in dict.fromkeys([*cpu, *stock, *GPU_DEFAULTS]):
        out[flag] = tuple(d[flag] or "" if flag in d else None for d in (cpu, stock, GPU_DEFAULTS))
    return out


def sglang_defaults_help() -> str:
    lines = ["SGLang flags the launcher sets unless given (CPU / CPU with --loopkv-stock / GPU; '-': not set):"]
    for flag, values in sglang_defaults().items():
        shown = ["-" if v is None else (v or "on") for v in values]
        lines.append(f"  {flag} {shown[0]}" if len(set(shown)) == 1 else f"  {flag} {' / '.join(shown)}")
    return "\n".join(lines)


def print_help(argv: list[str]) -> None:
    """sgl-loopkv's flags, the SGLang defaults it changes, then SGLang's own flags. Builds SGLang's
    parser without importing its server (whose import-time warnings about CUDA-only quantization and
    Triton say nothing about the flags)."""
    build_sglang_argv(argv)  # a bad --loopkv-* value fails here, as it would when serving
    loopkv_parser(add_help=False).print_help()
    print("\n" + sglang_defaults_help())
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs, add_attention_backend_choices

    if CPU_DEFAULTS["--attention-backend"] not in ATTENTION_BACKEND_CHOICES:  # what the plugin registers
        add_attention_backend_choices([CPU_DEFAULTS["--attention-backend"]])
    sglang = argparse.ArgumentParser(
        prog="sglang.launch_server",
        usage=argparse.SUPPRESS,
        add_help=False,
        description="SGLang's own flags follow, all accepted unchanged (--model-path is optional here).",
    )
    ServerArgs.add_cli_args(sglang)
    print()
    sglang.print_help()


def build_sglang_argv(argv: list[str]) -> tuple[LoopKVConfig, list[str], bool]:
    """Split argv into sgl-loopkv's config and SGLang's argv (with defaults and the model filled
    in). Sets up this process for the chosen device. Returns (config, sglang argv, on_gpu)."""
    parser = loopkv_parser(add_help=False)
    ns, rest = parser.parse_known_args(argv)
    try:
        config = LoopKVConfig.from_cli_args(ns)
    except ValueError as e:  # a section's own check: a usage error like argparse's, not a traceback
        parser.error(str(e))
    if config.lifecycle.disk_key_file:  # read again where the tier opens; a bad key stops the launch here
        from sgl_loopkv.cache.cipher import KeyFileError, load_key

        try:
            load_key(config.lifecycle.disk_key_file)
        except KeyFileError as e:
            parser.error(str(e))
    if not config.stock:  # before SGLang is imported here or in a subprocess: see sglang_archs
        os.environ.setdefault(sglang_archs.ENV, sglang_archs.PACKAGE)
    on_gpu = config.device == "cuda" or (config.device == "auto" and has_cuda())
    if not _given(rest, "--model-path") and not {"-h", "--help"} & set(rest):
        rest = default_model_start(config, rest, on_gpu)
    if not on_gpu:
        use_cpu_engine()
        rest = gguf_model_start(config, rest, argv)
    if config.weights == "auto":  # the subprocesses get what was chosen: a folder's float weights
        config.weights = "float32"
    config.to_env()
    activate_cpu_standin()
    if config.weights == "gguf":
        refuse_gguf_weights_without_a_source(_value(rest, "--model-path"), on_gpu)
    if on_gpu:
        defaults = {"--enable-cache-report": None} if config.stock else GPU_DEFAULTS
    else:
        defaults = cpu_defaults(config.stock)
    argv = with_defaults(rest, defaults)
    if not config.stock:  # the paged cache's rounding comes on top of the user's token budget
        argv = with_page_headroom(argv)
    return config, argv, on_gpu


def default_model_start(config: LoopKVConfig, rest: list[str], on_gpu: bool) -> list[str]:
    """No ``--model-path``: the embedded default model. On the CPU (``--loopkv-weights`` auto or gguf) its GGUF
    file, served from the blocks as any GGUF file is (:func:`gguf_model_start`); with ``--loopkv-weights
    float32``, ``--loopkv-stock`` or on a GPU, its float32 conversion (made once into ``--loopkv-cache-dir``),
    the weights stock SGLang can serve."""
    from sgl_loopkv.models import default_model_gguf, ensure_default_model

    if on_gpu or config.stock or config.weights == "float32":
        path = ensure_default_model(config.resolved_cache_dir)
    else:
        path = default_model_gguf()
    rest = ["--model-path", str(path), *rest]
    return rest if _given(rest, "--served-model-name") else [*rest, "--served-model-name", DEFAULT_MODEL_NAME]


def gguf_model_start(config: LoopKVConfig, rest: list[str], argv: list[str]) -> list[str]:
    """A CPU start whose ``--model-path`` is a GGUF file (or a folder of one): the file checked
    (:mod:`sgl_loopkv.models.gguf.serving`; a file it cannot serve exits here with the reason), served from
    its blocks (``config.weights`` becomes ``gguf``) over a bfloat16 KV pool unless ``--kv-cache-dtype``
    says otherwise, SGLang's argv pointed at the file. Other starts are returned as they are."""
    from sgl_loopkv.models.gguf.serving import GGUFError, check_servable, gguf_file_of, tokenizer_folder

    try:
        path = gguf_file_of(_value(rest, "--model-path"))
        if path is None:
            return rest
        if config.stock:
            raise GGUFError(
                f"{path}: --loopkv-stock is SGLang as it ships, whose GGUF kernels are CUDA-only: it cannot serve "
                "a GGUF file on the CPU (sgl-loopkv serves it without --loopkv-stock)"
            )
        if config.weights == "float32":
            raise GGUFError(f"{path}: a GGUF file is served from its blocks; --loopkv-weights float32 "
                            "needs a Hugging Face folder (or no --model-path: the default model's conversion)")  # fmt: skip
        own_tokenizer = _given(rest, "--tokenizer-path")
        check_servable(path, own_tokenizer)
        # a bfloat16 KV pool: half the bytes a decode step's attention reads, within the fidelity bar
        # against the float32 pool (docs/decisions/2026-12-06-gguf-bf16-kv.md); --kv-cache-dtype auto keeps float32
        defaults = {"--served-model-name": path.stem, "--kv-cache-dtype": "bf16"}
        if not own_tokenizer:
            defaults["--tokenizer-path"] = str(tokenizer_folder(path, config.resolved_cache_dir))
    except GGUFError as e:
        raise SystemExit(f"sgl-loopkv: {e}") from None
    config.weights = "gguf"
    # SGLang's GGUF loader reads a file: a folder of one becomes the file itself
    return with_defaults(["--model-path", str(path.resolve()), *_without(rest, "--model-path")], defaults)


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` with every ``flag value`` / ``flag=value`` taken out."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith(flag + "="):
            skip = False
            continue
        skip = a == flag
        if not skip:
            out.append(a)
    return out


def refuse_gguf_weights_without_a_source(model_path: str, on_gpu: bool) -> None:
    """``--loopkv-weights gguf`` serves a GGUF file, or a model converted from one (the default model), on
    the CPU; any other start exits here, before SGLang loads anything."""
    from sgl_loopkv.models.default_model import converted_from
    from sgl_loopkv.models.gguf.serving import gguf_file_of

    if on_gpu:
        raise SystemExit("sgl-loopkv: --loopkv-weights gguf runs on the CPU only (start with --loopkv-device cpu)")
    if gguf_file_of(model_path) is None and converted_from(model_path) is None:
        raise SystemExit(
            "sgl-loopkv: --loopkv-weights gguf serves a GGUF file (--model-path x.gguf) or the embedded default "
            f"model (no --model-path); {model_path} is neither"
        )


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


#: sgl-loopkv's name in SGLang's plugin group (pyproject.toml, ``[project.entry-points."sglang.srt.plugins"]``)
PLUGIN_ENTRY_POINT = "loopkv"


def register_plugin() -> None:
    """Register sgl-loopkv's SGLang plugin in this process through its entry point, as SGLang's own
    loader does. The launcher does not import the plugin: the plugin wires the server's request hooks
    in, so it sits above this package (pyproject.toml's import contract)."""
    from importlib.metadata import entry_points

    found = entry_points(group="sglang.srt.plugins", name=PLUGIN_ENTRY_POINT)
    if not found:
        raise SystemExit(
            f"sgl-loopkv's SGLang plugin (entry point {PLUGIN_ENTRY_POINT!r}) is not installed here: run ./install.sh"
        )
    next(iter(found)).load()()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print_help(argv)
        return
    config, sglang_argv, _ = build_sglang_argv(argv)

    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sgl_loopkv.server.forget import install_route
    from sgl_loopkv.server.limits import install_http_limits
    from sgl_loopkv.server.redact import redact_server_args
    from sgl_loopkv.server.rendezvous import private_rendezvous
    from sgl_loopkv.server.retention import install_retention_hints

    load_plugins()  # our entry point and any other installed plugin, as sglang.launch_server does
    register_plugin()  # idempotent; keeps loopkv available even if SGLANG_PLUGINS filters entry points
    server_args = prepare_server_args(sglang_argv)
    refuse_a_taken_port(server_args.host, server_args.port)
    redact_server_args(server_args)  # /server_info shows the command line: no keys in it
    # Only the one-tokenizer app: with --tokenizer-worker-num > 1 uvicorn workers import a fresh app.
    install_http_limits(app, config.limits)
    install_route(app)  # POST /loopkv/forget
    install_retention_hints(app)  # the "loopkv" body field (retain / ttl)
    try:
        with private_rendezvous(server_args):  # no scheduler socket on every interface
            run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
