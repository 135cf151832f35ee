"""Settings shared by tests/unit and tests/e2e: the report header and the rule that every test using a
server carries the ``server`` marker (``-m "not server"`` must start none)."""

from __future__ import annotations

import os

import pytest

from sgl_loopkv.config import LoopKVConfig

#: fixtures that start a server process (tests/e2e/conftest.py and test modules)
SERVER_FIXTURES = {
    "tiny_server",
    "tiny_native_server",
    "smollm2_server",
    "tiny_sparse_server",
    "capped_server",
    "plain_sglang_server",
    "keyed_server",
    "faults_server",
    "fuzz_server",
}


def pytest_collection_modifyitems(config, items):
    unmarked = [i.nodeid for i in items if SERVER_FIXTURES & set(i.fixturenames) and not i.get_closest_marker("server")]
    if unmarked:
        raise pytest.UsageError(f"tests that start a server must carry @pytest.mark.server: {unmarked}")


def pytest_report_header(config):
    return f"sgl-loopkv cache dir: {LoopKVConfig().resolved_cache_dir}; torch threads: {os.cpu_count()}"
