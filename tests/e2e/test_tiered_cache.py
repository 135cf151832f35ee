"""The loopkv radix cache in a real server: conversations evicted to host and to disk resume with
greedy output identical to a server that never evicted; a second server on the same disk tier
resumes the first one's conversations, and goes on with them once the first has stopped;
flipped, truncated and deleted extents are detected and recomputed; quotas hold."""

from __future__ import annotations

import json
import struct
import time

import pytest
import requests

from benchmarks.common import metrics
from sgl_loopkv.restore.restorer import STAGES
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS

pytestmark = pytest.mark.server

N_CONV = 6


def conversation(i: int) -> str:
    facts = " ".join(
        f"In story {i}, room {j} holds {(i * 7 + j * 3) % 11} {['lamps', 'books', 'cups'][j % 3]}." for j in range(70)
    )
    return f"Conversation {i}. {facts}"  # ~900 tokens


def ask(url: str, i: int, turn: str = "How many lamps are in room 3?") -> dict:
    body = {
        "text": conversation(i) + " Question: " + turn,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tiers(resp: dict) -> dict:
    d = resp["meta_info"].get("cached_tokens_details") or {}
    return {"device": d.get("device", 0), "host": d.get("host", 0), "disk": d.get("storage", 0)}


def segment_files(disk_root) -> dict[str, list[int]]:
    """seg file -> its first token ids (read from the header, as a user inspecting the dir would)."""
    out = {}
    for f in disk_root.glob("*/seg_*.kv"):
        raw = f.read_bytes()
        hlen = struct.unpack("<I", raw[8:12])[0]
        header = json.loads(raw[16 : 16 + hlen])
        out[f] = (header["start"], header["token_ids"][:24])
    return out


def files_of(disk_root, tokenizer, i: int):
    """Segment files holding conversation ``i``'s first tokens."""
    prefix = tokenizer(conversation(i))["input_ids"][:24]
    return [f for f, (start, ids) in segment_files(disk_root).items() if start == 0 and ids == prefix]


def host_arena_bytes(url: str) -> float:
    """The host tier's size as the server reports it on /metrics."""
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("loopkv_tier_bytes") and 'tier="host"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(
        "loopkv_tier_bytes{tier=host} missing from /metrics: " + requests.get(f"{url}/metrics", timeout=30).text[-3000:]
    )


def disk_bytes(disk_root) -> int:
    """Bytes of the segment files (one the server's disk writer evicts while we list is not there)."""
    total = 0
    for f in disk_root.glob("*/seg_*.kv"):
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            continue
    return total


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loopkv-disk")


DISK_QUOTA = 4_000_000  # ~7 tiny-model conversations
HOST_QUOTA = 2_200_000  # ~4


def tiered(tiny_model_dir, disk_dir, log, timeout_s: float = 600) -> ServerProcess:
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "2048"),  # the device pool holds ~2 conversations
        *("--loopkv-tier-host-bytes", str(HOST_QUOTA)),  # the host arena ~4
        *("--loopkv-tier-disk-dir", str(disk_dir), "--loopkv-tier-disk-bytes", str(DISK_QUOTA)),
        "--enable-metrics",
    ]
    return ServerProcess(args, log_path=log).start(timeout_s)


def wait_for_files(disk_root, tokenizer, i, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if files_of(disk_root, tokenizer, i):
            return
        time.sleep(0.2)
    raise AssertionError(f"conversation {i} never reached the disk tier")


def test_resume_from_host_and_disk_a_second_server_and_faults(
    tiny_server, tiny_model_dir, disk_dir, server_logs, tokenizer
):
    """Two starts: the second server, started on the first one's directory, goes on alone once the
    first has stopped (a restart after a kill -9 is test_faults.py's, after a clean stop the slow
    test_disk_tier_is_on_by_default_in_the_cache_dir_and_survives_a_restart)."""
    reference = {i: ask(tiny_server.url, i)["output_ids"] for i in range(N_CONV)}

    srv = tiered(tiny_model_dir, disk_dir, server_logs / "tiered-1.log")
    second = None
    try:
        for i in range(N_CONV):
            first = ask(srv.url, i)
            assert first["output_ids"] == reference[i]  # the tiered cache changes nothing on first sight
            wait_for_files(disk_dir, tokenizer, i)
        # conversation N-3: evicted from the device pool, still in the host arena
        host_hit = ask(srv.url, N_CONV - 3)
        assert tiers(host_hit)["host"] > 800, tiers(host_hit)
        assert host_hit["output_ids"] == reference[N_CONV - 3]
        # conversation 0: only on disk by now
        disk_hit = ask(srv.url, 0)
        assert tiers(disk_hit)["disk"] > 800, tiers(disk_hit)
        assert disk_hit["output_ids"] == reference[0]
        # A second server on the same directory and model shares it (issue 17): it never saw
        # conversation 1, and resumes it from the first one's segments with the same answer.
        second = tiered(tiny_model_dir, disk_dir, server_logs / "tiered-second.log", timeout_s=180)
        shared = ask(second.url, 1)
        details = shared["meta_info"]["cached_tokens_details"]
        assert tiers(shared)["disk"] > 800 and details["storage_shared"] == tiers(shared)["disk"], details
        assert shared["output_ids"] == reference[1]
        assert ask(srv.url, 1)["output_ids"] == reference[1]  # the first one is unharmed
    except BaseException:
        if second is not None:
            second.stop()
        raise
    finally:
        srv.stop()

    # The first server gone, the second one alone on the directory: what the first stored comes back.
    try:
        resumed = ask(second.url, N_CONV - 1)
        assert tiers(resumed)["disk"] > 800, tiers(resumed)
        assert resumed["output_ids"] == reference[N_CONV - 1]

        # Faults on stored extents: each must be detected (no cached tokens from it) and recomputed.
        for i, fault in ((2, "flip"), (3, "truncate"), (4, "delete")):
            files = files_of(disk_dir, tokenizer, i)
            assert files, f"conversation {i} is not on disk"
            for f in files:
                data = bytearray(f.read_bytes())
                if fault == "flip":
                    data[len(data) // 2] ^= 0x5A
                    f.write_bytes(bytes(data))
                elif fault == "truncate":
                    f.write_bytes(bytes(data[: len(data) // 2]))
                else:
                    f.unlink()
            out = ask(second.url, i)
            assert tiers(out)["disk"] == 0 and out["meta_info"]["cached_tokens"] < 100, (fault, tiers(out))
            assert out["output_ids"] == reference[i], fault

        # Many more conversations: both quotas hold throughout.
        for i in range(N_CONV, N_CONV + 8):
            ask(second.url, i)
            assert disk_bytes(disk_dir) <= DISK_QUOTA
            assert 0 < host_arena_bytes(second.url) <= HOST_QUOTA
        assert disk_bytes(disk_dir) > DISK_QUOTA // 2  # the tier is really used, not bypassed
    finally:
        second.stop()


@pytest.mark.slow  # the loader under another backend; the default path's loads are in every resume test above
def test_resume_under_torch_native_attention_loads_layer_by_layer(tiny_native_server, tiny_model_dir, server_logs):
    """SGLang's own ``torch_native`` attention + the loopkv cache: a history evicted to the host
    tier comes back through the loader thread, the forward waiting per layer in the KV pool's
    ``get_key_buffer`` (our layer transfer counter), and greedy output is unchanged."""
    reference = {i: ask(tiny_native_server.url, i)["output_ids"] for i in range(4)}
    log = server_logs / "tiered-torch-native.log"
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:]),
        *("--max-total-tokens", "2048", "--loopkv-tier-host-bytes", str(HOST_QUOTA)),
        *("--attention-backend", "torch_native", "--enable-metrics"),
    ]
    # on a CPU pool loads run before the forward; this keeps the loader thread, as on a GPU
    srv = ServerProcess(args, env={"LOOPKV_LOAD_BESIDE_FORWARD": "1"}, log_path=log).start()
    try:
        for i in range(4):
            assert ask(srv.url, i)["output_ids"] == reference[i]
        back = ask(srv.url, 0)  # evicted from the device pool by conversations 1-3, still in the host arena
        assert tiers(back)["host"] > 800, tiers(back)
        assert back["output_ids"] == reference[0]
        seconds = {p: metrics(srv.url).get(f'loopkv_restore_seconds_total{{part="{p}"}}', 0.0) for p in STAGES}
    finally:
        srv.stop()
    # the resume went through the loader thread (the pool's layer transfer counter), not a copy before the forward
    assert seconds["copy"] > 0 and seconds["loads_first"] == 0, seconds


@pytest.mark.slow  # 55 s: three servers; restarts on one directory are in the default suite above
def test_disk_tier_is_on_by_default_in_the_cache_dir_and_survives_a_restart(
    tiny_model_dir, tmp_path, server_logs, tokenizer
):
    """No disk flag at all: the stored conversation lands under ``<cache-dir>/kv`` with private
    permissions and comes back from disk after a restart."""
    cache = tmp_path / "cache"
    args = ["--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS, "--loopkv-cache-dir", str(cache)]

    def default_server(name: str, timeout_s: float = 600) -> ServerProcess:
        log = server_logs / f"default-disk-{name}.log"
        return ServerProcess(args, private_disk_dir=False, log_path=log).start(timeout_s)

    with default_server("1") as srv:
        first = ask(srv.url, 0)
        wait_for_files(cache / "kv", tokenizer, 0)
    kv_root = cache / "kv"
    (model_dir,) = [d for d in kv_root.iterdir() if d.is_dir()]
    for path in (kv_root, model_dir, *model_dir.iterdir()):
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}: readable by others"
    with default_server("2") as srv:
        resumed = ask(srv.url, 0)
        assert tiers(resumed)["disk"] > 800, tiers(resumed)
        assert resumed["output_ids"] == first["output_ids"]
    # two servers on one directory share it: test_resume_from_host_and_disk_a_second_server_and_faults
