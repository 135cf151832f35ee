"""API keys out of what SGLang shows: ``GET /server_info``, the start-up log, crash dumps.

SGLang 0.5.23 redacts only its watermark secrets there. ``GET /server_info`` (an ordinary route: the
API key opens it) returned ``api_key`` and ``admin_api_key`` in clear, in its server args, in each
scheduler's internal state and in ``launch_command`` (the command line, ``ServerArgs._launch_command``
set by ``prepare_server_args``): anyone holding the ordinary key read the admin key, and with it the
admin routes (weights and LoRA adapters loaded from any path, profiler output directories, ...). The
start-up log line ``server_args=...`` showed both too.

- :func:`redact_secret_fields`, an AFTER hook on SGLang's ``redact_watermark_secrets`` (every one of
  those outputs goes through it, nothing else does): dict entries named like a secret field.
- :func:`redact_server_args`, called by the launcher: the secret values in ``launch_command``.

The fields of the live ``ServerArgs`` keep their values (SGLang's key middleware reads them).
"""

from __future__ import annotations

from typing import Any

from sgl_loopkv.config import LoopKVConfig

REDACT_TARGET = "sglang.srt.sampling.watermarking.core.redact_watermark_secrets"

#: ServerArgs field -> its flag
SECRET_FLAGS = {
    "api_key": "--api-key",
    "admin_api_key": "--admin-api-key",
    "ssl_keyfile_password": "--ssl-keyfile-password",
}
REDACTED = "<redacted>"


def redact_launch_command(command: str | None, server_args) -> str | None:
    """``command`` (the argv joined by spaces) with every secret flag's value replaced, in both the
    ``--flag value`` and the ``--flag=value`` spelling; matching the value itself, so a value with a
    space in it goes whole."""
    if not command:
        return command
    for name, flag in SECRET_FLAGS.items():
        value = getattr(server_args, name, None)
        if value:
            for sep in (" ", "="):
                command = command.replace(f"{flag}{sep}{value}", f"{flag}{sep}{REDACTED}")
    return command


def redact_server_args(server_args) -> None:
    """Redact ``server_args``' launch command in place (before SGLang copies it to its processes)."""
    server_args._launch_command = redact_launch_command(server_args.launch_command, server_args)


def redact_secret_fields(result: Any, *args, **kwargs) -> Any:
    """AFTER hook: ``result`` with every dict entry named like a secret field (at any depth) and set
    replaced by ``<redacted>``; in servers of sgl-loopkv's launcher only."""
    return _redact(result) if LoopKVConfig.launched() else result


def _redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if k in SECRET_FLAGS and v else _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value
