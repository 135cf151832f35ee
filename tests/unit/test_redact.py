"""API keys out of SGLang's launch_command and shown dicts (server/redact.py), and when the launcher
replaces torch.distributed's TCP rendezvous by a private file (server/rendezvous.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from sgl_loopkv.config import ENV_VAR as LOOPKV_ENV
from sgl_loopkv.server import redact
from sgl_loopkv.server.rendezvous import ENV_VAR, private_rendezvous, wants_private_rendezvous


def test_launch_command_loses_every_key_spelling():
    args = SimpleNamespace(api_key="a key", admin_api_key="ADM", ssl_keyfile_password=None)
    cmd = "--model-path /m --api-key a key --admin-api-key=ADM --port 1"
    out = redact.redact_launch_command(cmd, args)
    assert out == "--model-path /m --api-key <redacted> --admin-api-key=<redacted> --port 1"
    assert redact.redact_launch_command(None, args) is None


def test_shown_dicts_lose_set_keys_at_any_depth(monkeypatch):
    shown = {"api_key": "K", "admin_api_key": None, "port": 1, "internal_states": [{"admin_api_key": "A"}]}
    monkeypatch.setenv(LOOPKV_ENV, "{}")  # a server of sgl-loopkv's launcher
    assert redact.redact_secret_fields(shown) == {
        "api_key": "<redacted>",
        "admin_api_key": None,
        "port": 1,
        "internal_states": [{"admin_api_key": "<redacted>"}],
    }
    monkeypatch.delenv(LOOPKV_ENV)  # a plain sglang.launch_server stays as SGLang made it
    assert redact.redact_secret_fields(shown) is shown


def server_args(**kw):
    return SimpleNamespace(**{"nnodes": 1, "dist_init_addr": None, "dp_size": 1, **kw})


@pytest.mark.parametrize(
    "kw,wanted",
    [({}, True), ({"nnodes": 2}, False), ({"dist_init_addr": "10.0.0.1:5000"}, False), ({"dp_size": 2}, False)],
)
def test_private_rendezvous_only_on_one_node_and_one_replica(monkeypatch, kw, wanted):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert wants_private_rendezvous(server_args(**kw)) is wanted


def test_private_rendezvous_is_a_private_file_gone_afterwards(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with private_rendezvous(server_args()) as root:
        assert os.environ[ENV_VAR] == (root / "store").as_uri()
        assert root.stat().st_mode & 0o077 == 0
    assert not root.exists() and ENV_VAR not in os.environ
    monkeypatch.setenv(ENV_VAR, "env://")  # the user's own choice stays
    with private_rendezvous(server_args()) as root:
        assert root is None and os.environ[ENV_VAR] == "env://"
