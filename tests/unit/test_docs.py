"""The README and the docs pages against what they describe: measured values equal their results files
(``docs/headlines.py``), the README's test command is CI's, every exported metric is documented, and the
README stays short and readable."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _headlines():
    spec = importlib.util.spec_from_file_location("docs_headlines", ROOT / "docs" / "headlines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


headlines = _headlines()


def test_every_quoted_value_equals_its_results_file():
    values = headlines.scan(headlines.default_files())
    assert any(v.file == README for v in values), "the README quotes no measured value through a marker"
    stale = [f"{v.file.name}:{v.line} {v.spec}: {v.shown!r} != {v.expected!r}" for v in values if v.shown != v.expected]
    assert not stale, "run python docs/headlines.py:\n" + "\n".join(stale)


def test_a_value_that_differs_from_its_results_file_is_reported_and_rewritten(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench.json").write_text(
        json.dumps(
            {
                "summary": {"ratio": 2.345, "by": {"0.5": 0.75}},
                "env": {"when": "2026-01-02T03:04:05", "machine": "x86_64", "cpu_count": 2},
            }
        )
    )
    monkeypatch.setattr(headlines, "RESULTS", results)
    page = tmp_path / "page.md"
    page.write_text(
        "a <!-- value bench summary.ratio {:.2f}x -->9.99x<!-- /value --> b "
        "<!-- value bench summary.by[0.5] -->0.75<!-- /value --> on <!-- value bench @date -->x<!-- /value -->, "
        "<!-- value bench @machine -->x86_64, 2 cores<!-- /value -->\n"
    )
    stale = [v for v in headlines.scan([page]) if v.shown != v.expected]
    assert [(v.spec, v.shown, v.expected) for v in stale] == [
        ("bench summary.ratio", "9.99x", "2.35x"),
        ("bench @date", "x", "2026-01-02"),
    ]
    assert headlines.main(["--check", str(page)]) == 1
    assert headlines.rewrite([page]) == 2
    assert "-->2.35x<!-- /value -->" in page.read_text() and headlines.main(["--check", str(page)]) == 0


def test_cpu_kind_names_the_model_and_its_matrix_instructions():
    xeon = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_flags": {"avx512_bf16": True, "amx_bf16": True}}
    epyc = {"cpu_model": "AMD EPYC", "cpu_flags": {"avx2": True, "avx512f": True, "avx512_bf16": True}}
    assert headlines.cpu_kind(xeon) == "Intel Xeon Processor, AMX-BF16"
    assert headlines.cpu_kind(epyc) == "AMD EPYC, AVX512-BF16 without AMX"
    assert headlines.cpu_kind({"cpu_model": "X", "cpu_flags": {"avx2": True}}) == "X, AVX2"
    with pytest.raises(KeyError):  # an older record without the model: the marker fails, never guesses
        headlines.cpu_kind({"machine": "x86_64"})


@pytest.mark.parametrize(
    "marker, message",
    [
        ("<!-- value nosuch summary.x -->1<!-- /value -->", "no results file"),
        ("<!-- value bench summary.missing -->1<!-- /value -->", "has no 'summary.missing'"),
        ("<!-- value bench summary.text {:.2f} -->1<!-- /value -->", "does not fit"),
    ],
)
def test_a_marker_that_does_not_resolve_names_its_file_and_line(tmp_path, monkeypatch, marker, message):
    (tmp_path / "bench.json").write_text(json.dumps({"summary": {"text": "abc"}}))
    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("first line\n" + marker + "\n")
    with pytest.raises(headlines.HeadlineError, match=rf"page.md:2: .*{re.escape(message)}"):
        headlines.scan([page])


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_second_command_is_what_ci_runs():
    first_block = _fenced_blocks(README.read_text())[0].splitlines()
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert len(first_block) == 2 and len(ci) == 1
    assert first_block[1].strip() == ci[0].strip()
    assert "sphinx -W" in ci[0], "CI builds the docs strictly"


def test_the_readme_is_short_and_readable():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\bissues? \d+|#\d+\b", text, flags=re.I), "a reader cannot look up issue numbers"
    assert "<!-- results:" not in text, "no generated results blocks"
    for row in (line for line in text.splitlines() if line.startswith("|")):
        for cell in row.strip("|").split("|"):
            visible = re.sub(r"<!--.*?-->|\]\([^)]*\)", " ", cell)
            assert len(visible.split()) <= 40, f"table cell over 40 words: {cell.strip()[:80]}"


def test_every_exported_metric_is_on_the_metrics_page():
    defined = set()
    for path in [*(ROOT / "sgl_loopkv").rglob("*.py"), *(ROOT / "server").rglob("*.py")]:
        defined |= set(re.findall(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"(loopkv_\w+)\"", path.read_text()))
    assert len(defined) > 20, "the metric definitions moved: update this test's search"
    page = (ROOT / "docs" / "operating" / "metrics.md").read_text()
    missing = sorted(name for name in defined if f"`{name}`" not in page)
    assert not missing, f"metrics missing from docs/operating/metrics.md: {missing}"


def test_no_line_starts_with_a_value_marker():
    """CommonMark (GitHub, MyST) reads a line starting with ``<!--`` as a raw HTML block: the paragraph
    around the value would break there."""
    bad = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in headlines.default_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.lstrip().startswith("<!-- value")
    ]
    assert not bad, f"a value marker starts these lines (join it to the line before): {bad}"
