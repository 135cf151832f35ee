"""Access: the server listens on loopback only unless told otherwise, SGLang's ``--api-key`` guards every
route but the health probes (and ``--admin-api-key`` the admin routes, among them those that read a
path from the request), and no request string reaches the file system: the disk tier's file names
are hashes and minted ids, never ``rid``, ``extra_key``, ``cache_salt`` or a model name."""

from __future__ import annotations

import http.client
import ipaddress
import os
import re
import socket
import tempfile
import uuid
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest
import requests

from sgl_loopkv.config import LoopKVConfig
from tests.e2e.conftest import ADMIN_KEY, API_KEY
from tests.helpers import run_fresh

KEY = {"Authorization": f"Bearer {API_KEY}"}
# SGLang's decide_request_auth lets these through without a key (probes, Prometheus scraping): by path
# prefix /health, /ready, /metrics.
KEYLESS = {"/health", "/health_generate", "/ready", "/metrics"}


@pytest.fixture(scope="module")
def sglang_app() -> dict:
    """SGLang's HTTP routes (path, methods, auth level, websocket?) and the host that sgl-loopkv's
    launcher hands SGLang when the command line names none, from a fresh interpreter (importing
    SGLang's HTTP server sets up the CPU engine in the importing process)."""
    return run_fresh(
        """
        import json
        from sgl_loopkv.server.launch import build_sglang_argv
        from sgl_loopkv.plugin import register
        _, argv, _ = build_sglang_argv(["--model-path", "/no/such/model", "--loopkv-tier-disk-dir", "none"])
        register()
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.entrypoints.http_server import app
        from starlette.routing import WebSocketRoute

        def flat(routes, prefix="", included=False):
            for r in routes:
                if hasattr(r, "original_router"):  # FastAPI 0.16x keeps an included router as one object
                    yield from flat(r.original_router.routes, prefix + r.include_context.prefix, True)
                else:
                    yield prefix, r, included

        routes = [
            {
                "path": prefix + r.path,
                "methods": sorted(getattr(r, "methods", None) or []),
                "level": getattr(getattr(getattr(r, "endpoint", None), "_auth_level", None), "value", "normal"),
                "websocket": isinstance(r, WebSocketRoute),
                "included": included,
            }
            for prefix, r, included in flat(app.routes)
        ]
        print(json.dumps({"host": prepare_server_args(argv).host, "routes": routes}))
        """
    )


def test_launcher_binds_loopback_by_default(sglang_app):
    assert sglang_app["host"] == "127.0.0.1"


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.server
def test_every_listening_socket_of_the_server_is_on_loopback(keyed_server):
    """The HTTP port and every internal one (ZMQ, torch.distributed's rendezvous, gloo): torch's
    TCPStore listens on all interfaces whatever host it is given, so the launcher rendezvous through a
    private file instead (sgl_loopkv/server/rendezvous.py)."""
    exposed, seen = [], 0
    for pid in keyed_server.pids():
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                seen += 1
                if not is_loopback(c.laddr.ip):
                    exposed.append((psutil.Process(pid).name(), c.laddr))
    assert seen >= 1 and not exposed, exposed  # seen: at least the HTTP port


def probe(url: str, method: str, path: str, headers: dict | None = None) -> int:
    body = None if method in ("GET", "HEAD") else {}  # harmless: every guarded route refuses before parsing
    return requests.request(method, url + path, json=body, headers=headers, timeout=120).status_code


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)  # /v1/models/{model:path} -> /v1/models/x


@pytest.mark.server
def test_api_key_guards_every_route_but_the_health_probes(keyed_server, sglang_app):
    """Every route of SGLang's app (from the app itself, so routes hidden from /openapi.json count)
    and of the live /openapi.json, every method, without a key: 401/403, except the probes."""
    live = requests.get(f"{keyed_server.url}/openapi.json", headers=KEY, timeout=30)
    assert live.status_code == 200
    calls = {(m, concrete(r["path"])) for r in sglang_app["routes"] if not r["websocket"] for m in r["methods"]}
    calls |= {(m.upper(), concrete(p)) for p, ops in live.json()["paths"].items() for m in ops}
    calls.add(("GET", "/metrics"))  # mounted at start-up by --enable-metrics, in neither list
    assert len(calls) > 80  # the enumeration found SGLang's routes
    opened, guarded = set(), 0
    for method, path in sorted(calls):
        status = probe(keyed_server.url, method, path)
        if status in (401, 403):
            guarded += 1
        else:
            opened.add((method, path, status))
    assert opened == {("GET", p, 200) for p in KEYLESS}, opened
    # a wrong key, and the admin key on an ordinary route, are no API key
    for headers in (
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {ADMIN_KEY}"},
        {"X-Api-Key": API_KEY},
    ):
        assert probe(keyed_server.url, "GET", "/v1/models", headers) == 401
    assert probe(keyed_server.url, "GET", "/v1/models", KEY) == 200


def admin_routes(sglang_app, included: bool) -> set[tuple[str, str]]:
    return {
        (m, concrete(r["path"]))
        for r in sglang_app["routes"]
        if r["level"] != "normal" and r["included"] == included
        for m in r["methods"]
    }


@pytest.mark.server
def test_admin_routes_refuse_the_api_key(keyed_server, sglang_app):
    """With ``--admin-api-key``, SGLang's admin routes (weights from a path on disk, LoRA adapters from
    a path, profiler output directories, /flush_cache, pausing, aborting, ...) take only the admin key."""
    admin = admin_routes(sglang_app, included=False)
    assert ("POST", "/update_weights_from_disk") in admin and ("POST", "/load_lora_adapter") in admin
    refused = {(method, path): probe(keyed_server.url, method, path, KEY) for method, path in sorted(admin)}
    assert {k: v for k, v in refused.items() if v != 401} == {}
    for headers in (None, KEY):
        r = requests.post(
            f"{keyed_server.url}/update_weights_from_disk", json={"model_path": "/etc"}, headers=headers, timeout=60
        )
        assert r.status_code == 401, r.text


@pytest.mark.server
@pytest.mark.xfail(
    strict=True,
    reason="SGLang 0.5.23 + FastAPI 0.16x: the key middleware resolves an endpoint's auth level from "
    "app.router.routes, where an included router (elastic_ep's /scale_elastic_ep, /is_scaling_elastic_ep) "
    "is one _IncludedRouter object: its admin routes count as ordinary ones and take the API key",
)
def test_admin_routes_of_included_routers_refuse_the_api_key(keyed_server, sglang_app):
    admin = admin_routes(sglang_app, included=True)
    assert ("POST", "/scale_elastic_ep") in admin
    refused = {(method, path): probe(keyed_server.url, method, path, KEY) for method, path in sorted(admin)}
    assert {k: v for k, v in refused.items() if v != 401} == {}


def raw_status(url: str, request: bytes) -> str:
    """The status line the server answers a raw HTTP request with (no client-side path cleanup)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        return s.recv(4096).split(b"\r\n", 1)[0].decode()


@pytest.mark.server
def test_no_way_around_the_key(keyed_server):
    """Paths that start like a keyless probe but lead elsewhere, and a websocket upgrade (SGLang's key
    middleware passes websocket scopes through unchecked: /v1/realtime must not open without a key)."""
    for path in ("/health/../generate", "/metrics/../generate", "/health%2F..%2Fgenerate", "/ready/../v1/models"):
        conn = http.client.HTTPConnection(keyed_server.url.removeprefix("http://"), timeout=60)
        conn.request("POST", path, body=b"{}", headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        if resp.status == 200:  # only the Prometheus app mounted at /metrics answers whatever lies below it
            assert path.startswith("/metrics/") and b"# HELP" in body and b"meta_info" not in body, path
        else:
            assert resp.status in (401, 403, 404, 405), (path, resp.status)
    upgrade = (
        "GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    status = raw_status(keyed_server.url, upgrade.encode())
    assert " 101 " not in status + " ", status


@pytest.mark.server
def test_server_info_does_not_show_the_keys(keyed_server):
    """SGLang shows them in its args, each scheduler's state and the command line (server/redact.py)."""
    info = requests.get(f"{keyed_server.url}/server_info", headers=KEY, timeout=60)
    assert info.status_code == 200 and "--api-key <redacted>" in info.json()["launch_command"]
    assert API_KEY not in info.text and ADMIN_KEY not in info.text


@pytest.mark.server
def test_server_log_does_not_show_the_keys(keyed_server, server_logs):
    text = (server_logs / "keyed.log").read_text(errors="replace")
    assert "server_args=" in text  # the line that would show them
    assert API_KEY not in text and ADMIN_KEY not in text


# --- hostile request strings ----------------------------------------------------------------------------
MARK = f"lkvhostile{uuid.uuid4().hex[:8]}"
HOSTILE = [
    f"../../../../../../tmp/{MARK}-rel",
    f"/tmp/{MARK}-abs",
    f"{MARK}\x00nul",
    f"{MARK}\nnewline",
    MARK + "x" * 10240,
    f"{MARK}/../../{MARK}-up",
    f"C:\\{MARK}-win",
    f"%2e%2e%2f{MARK}-pct",
    f"~/{MARK}-home",
    "..",
    ".",
    "/",
    "",
    "lock",
    "index.json",
    "seg_" + "0" * 32 + ".kv",
]
# <disk dir>/<16 hex: model fingerprint>/{lock, evict.lock, workers, seg_<start>-<32 hex: chain hash>.kv,
# chunks/<32 hex: chain hash>(.pending), <host>.<pid>.<8 hex>.<bytes>.tmp while written}
DISK_NAME = re.compile(
    r"[0-9a-f]{16}(/(lock|evict\.lock|workers|seg_\d{6}-[0-9a-f]{32}\.kv|chunks(/[0-9a-f]{32}(\.pending)?)?|forgotten(/\d+-[0-9a-f]{8}\.json)?|[^/]+\.\d+\.[0-9a-f]{8}\.\d+\.tmp))?"
)
PROMPT = "Hostile strings test. " + " ".join(f"Bin {j} holds {j % 5} bolts." for j in range(6))  # > 2 pages


def files_named(mark: str, roots: list[Path]) -> list[str]:
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in (".venv", ".git")]
            found += [os.path.join(dirpath, n) for n in dirnames + filenames if mark in n]
    return found


@pytest.mark.server
def test_hostile_request_strings_never_name_a_file(keyed_server, keyed_disk_dir):
    import openai

    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    server_errors = []

    def check(what: str, status: int) -> None:
        if status >= 500:
            server_errors.append((what, status))

    for s in HOSTILE:
        fields = {"rid": s, "extra_key": s, "cache_salt": s}
        body = {"text": PROMPT, **fields, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        status = requests.post(f"{keyed_server.url}/generate", json=body, headers=KEY, timeout=120).status_code
        check(f"/generate {s[:40]!r}", status)
        try:  # the same as OpenAI extras
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=1, extra_body=fields
            )
        except openai.APIStatusError as e:
            check(f"chat extras {s[:40]!r}", e.status_code)
        for create, kw in (
            (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
            (client.completions.create, {"prompt": "hi"}),
        ):
            try:
                create(model=s, max_tokens=2, **kw)
                assert s == "", f"model {s[:40]!r} was served"  # only the empty name means "the default"
            except openai.APIStatusError as e:
                check(f"model={s[:40]!r}", e.status_code)
        check(
            f"GET /v1/models/{s[:40]!r}",
            requests.get(f"{keyed_server.url}/v1/models/{quote(s, safe='')}", headers=KEY, timeout=60).status_code,
        )
    assert not server_errors, server_errors
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    ok = requests.post(f"{keyed_server.url}/generate", json=body, headers=KEY, timeout=120)
    assert ok.status_code == 200  # still serving

    names = sorted(p.relative_to(keyed_disk_dir).as_posix() for p in keyed_disk_dir.rglob("*"))
    assert any("/seg_" in n for n in names)  # the requests were stored: the names below are really made
    assert [n for n in names if not DISK_NAME.fullmatch(n)] == []
    roots = [Path(tempfile.gettempdir()), keyed_disk_dir, LoopKVConfig().resolved_cache_dir, Path.cwd()]
    assert files_named(MARK, [r for r in roots if r.exists()]) == []
    assert not (Path.home() / f"{MARK}-home").exists() and not Path("/tmp", f"{MARK}-abs").exists()
