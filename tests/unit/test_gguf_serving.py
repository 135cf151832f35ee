"""A CPU start on a GGUF model path stops with a clear message while the GGUF serving path is not
built (issue 53, step 4); a Hugging Face folder and GPU starts are left to SGLang."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_loopkv.models.gguf.serving import NOT_BUILT, gguf_file_of, refuse_gguf_on_cpu


def test_gguf_model_paths_are_recognised(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_file_of(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    assert gguf_file_of(str(tmp_path)) == tmp_path / "m.gguf"  # a folder holding one
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file_of(str(tmp_path)) is None  # a Hugging Face folder
    assert gguf_file_of(str(tmp_path / "config.json")) is None
    assert gguf_file_of("") is None and gguf_file_of("HuggingFaceTB/SmolLM2-135M") is None
    with pytest.raises(SystemExit, match="not implemented yet"):
        refuse_gguf_on_cpu(str(tmp_path / "m.gguf"))


def test_a_cpu_start_on_a_gguf_file_exits_with_the_message(tmp_path):
    model = tmp_path / "my.gguf"
    model.write_bytes(b"GGUF")
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_loopkv.launch_server", "--model-path", str(model), "--loopkv-device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert NOT_BUILT in proc.stderr and str(model) in proc.stderr
    assert "Traceback" not in proc.stderr
