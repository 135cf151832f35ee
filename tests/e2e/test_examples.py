"""Every file in ``examples/`` runs against the suite's live tiny-model server as a user runs it
(``bash`` or ``python``, the server's address in ``URL``), and exits 0 having printed something.
The README's and the docs' copies of them are byte-checked in tests/unit/test_doc_blocks.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.unit.test_doc_blocks import EXAMPLES, example_files

pytestmark = pytest.mark.server

RUNNERS = {".sh": ["bash"], ".py": [sys.executable]}


def run(path, url: str) -> str:
    assert path.suffix in RUNNERS, f"{path.name}: no runner for {path.suffix} files (add one to RUNNERS)"
    proc = subprocess.run(
        [*RUNNERS[path.suffix], str(path)], env={**os.environ, "URL": url}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{path.name} printed nothing"
    return proc.stdout


@pytest.mark.parametrize(
    "path", [p for p in example_files() if p.name != "resume_conversation.py"], ids=lambda p: p.name
)
def test_example_runs(tiny_server, path):
    run(path, tiny_server.url)


def test_resume_conversation_comes_back_from_the_host_or_disk_tier(tiny_server):
    """The example pushes its conversation out of the device pool with others (twice as many tokens as
    the pool holds); the returning turn's history is then served from the host or the disk tier
    (all of it but a few pages that other conversations share, such as the chat template's start)."""
    out = run(EXAMPLES / "resume_conversation.py", tiny_server.url)
    back = re.search(r"^back .* (\d[\d,]*) cached \(device (\d[\d,]*), host (\d[\d,]*), disk (\d[\d,]*)\)$", out, re.M)
    assert back, out
    cached, device, host, disk = (int(x.replace(",", "")) for x in back.groups())
    assert host + disk > 0.9 * cached and device + host + disk == cached, out
