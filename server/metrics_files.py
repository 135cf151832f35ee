"""``GET /metrics`` survives a metrics file that another process is still creating.

With ``--enable-metrics`` every SGLang process keeps its metrics in its own mmap'd ``*.db`` files in
``PROMETHEUS_MULTIPROC_DIR``, and the HTTP server merges them all on each scrape. prometheus_client
(0.26.0 here) creates such a file empty and sizes it a moment later (``MmapedDict.__init__``); a
scrape that lists the directory in that moment reads 0 bytes, ``read_all_values_from_file`` raises
``struct.error``, and the scrape answers 500 with every process's metrics lost. Our suite hit it once
(2026-11-27: a tier gauge "missing" from ``/metrics``; the server log held the traceback). A process
killed inside that window leaves the empty file behind, and then every later scrape fails. Upstream:
prometheus/client_python#1199, fixes proposed (#1200, #1207) but not released.

What this module does: :func:`read_values_of_sized_file`, an AROUND hook on that reader, reads a
file shorter than its 8-byte header as one with nothing recorded yet, as ``MmapedDict.__init__``
itself treats a 0-byte file. Files only ever grow, so a file seen at 8 bytes or more is read as
before, and a damaged file still fails as loudly as it did.

The reader's hook is applied by :func:`hook_reader_on_mount`, a BEFORE hook on SGLang's
``add_prometheus_middleware`` (each HTTP process calls it to mount ``/metrics``), not when the plugin
loads: importing prometheus_client fixes its value class from ``PROMETHEUS_MULTIPROC_DIR`` at that
moment, and the launcher loads plugins before SGLang sets that variable, so an early import made the
HTTP process keep its own counters in memory, off ``/metrics`` (``sglang:prompt_tokens_total`` went
missing; ``tests/e2e/test_api_conformance.py`` caught it). ``tests/unit/test_metrics_files.py`` fails
once prometheus_client reads empty files by itself: then this module can go.
"""

from __future__ import annotations

import os

MOUNT_TARGET = "sglang.srt.utils.common.add_prometheus_middleware"
READER_TARGET = "prometheus_client.mmap_dict.MmapedDict.read_all_values_from_file"
HEADER_BYTES = 8  # the used-bytes counter and its padding, written right after the file is sized
_reader_hooked = False


def read_values_of_sized_file(original, filename):
    if os.path.getsize(filename) < HEADER_BYTES:
        return []
    return original(filename)


def hook_reader_on_mount(*args, **kwargs) -> None:
    global _reader_hooked
    if _reader_hooked:  # a second mount in this process (another app) wraps the reader once only
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(READER_TARGET, read_values_of_sized_file, HookType.AROUND)
    HookRegistry.apply_hooks()
    _reader_hooked = True
