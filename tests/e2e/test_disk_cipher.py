"""Encryption at rest in a real server (issue 55, part 4): with ``--loopkv-lifecycle-disk-key-file`` a disk
resume gives the same greedy output as a server that never evicted, no segment file holds the
conversation's token ids, and a flipped byte in every file gives a recompute with the right answer."""

from __future__ import annotations

import os
import struct
import time

import pytest

from sgl_loopkv.cache.layout import PREAMBLE_BYTES, align_up
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS
from tests.e2e.test_tiered_cache import ask, conversation, tiers

pytestmark = pytest.mark.server


def token_runs(ids: list[int]) -> list[bytes]:
    run = ids[8:24]  # past the BOS and the shared "Conversation i." opening
    return [", ".join(map(str, run)).encode(), struct.pack(f"<{len(run)}i", *run), struct.pack(f"<{len(run)}q", *run)]


# slow (a server of its own): encryption is opt-in; no plaintext ids, a wrong key and a flipped byte
# degrading to recompute are tests/unit/test_disk_cipher.py's, on the store the server uses
@pytest.mark.slow
def test_encrypted_disk_resume_matches_and_hides_token_ids(tiny_server, tiny_model_dir, server_logs, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    key = tmp_path / "disk.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    disk = tmp_path / "disk"
    reference = {i: ask(tiny_server.url, i)["output_ids"] for i in range(4)}
    args = [
        *("--model-path", str(tiny_model_dir), *COMMON_SERVER_ARGS[2:], "--max-total-tokens", "2048"),
        *("--loopkv-tier-host-bytes", "0", "--loopkv-tier-disk-dir", str(disk)),
        *("--loopkv-lifecycle-disk-key-file", str(key)),
    ]
    with ServerProcess(args, log_path=server_logs / "encrypted.log").start(600) as srv:
        for i in range(4):  # the device pool holds ~2: conversation 0 is evicted to disk (no host arena)
            assert ask(srv.url, i)["output_ids"] == reference[i]
        deadline = time.monotonic() + 20
        while len(files := list(disk.glob("*-key-*/seg_*.kv"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(files) >= 4, files
        resumed = ask(srv.url, 0)
        assert tiers(resumed)["disk"] > 800, tiers(resumed)
        assert resumed["output_ids"] == reference[0]
        for i in range(4):
            runs = token_runs(tok(conversation(i))["input_ids"])
            for f in disk.glob("*-key-*/seg_*.kv"):
                raw = f.read_bytes()
                assert not any(r in raw for r in runs), f"{f.name} holds conversation {i}'s token ids"
        for f in disk.glob("*-key-*/seg_*.kv"):  # one flipped byte in the first extent of every file
            data = bytearray(f.read_bytes())
            data[align_up(PREAMBLE_BYTES + struct.unpack("<I", data[8:12])[0]) + 7] ^= 0x10
            f.write_bytes(bytes(data))
        for i in (1, 2):  # conversation 0 is evicted again
            ask(srv.url, i)
        again = ask(srv.url, 0)
        assert tiers(again)["disk"] == 0, tiers(again)  # the damaged file is not served: recomputed
        assert again["output_ids"] == reference[0]
