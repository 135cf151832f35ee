"""One-off studies: each measured a question once, and a design-decision page states its
conclusion. They run as ``python -m benchmarks.studies.<name>`` and write
``benchmarks/results/studies/<name>.{json,md,png}``; they are not maintained like the benchmarks
in :mod:`benchmarks.harness.registry` (no generated page, no staleness mark). :mod:`.fuzz` is also the
test suite's API fuzzer (tests/unit/test_fuzz.py, tests/e2e/test_fuzz.py import it)."""

from __future__ import annotations

from benchmarks.harness import results as _results

RESULTS = _results.RESULTS / "studies"


def write_results(name: str, payload: dict, markdown: str):
    """:func:`benchmarks.harness.results.write_results` under ``results/studies/``."""
    return _results.write_results(f"studies/{name}", payload, markdown)
