"""The GPU bundle builder (benchmarks/gpu_bundle.py): what it carries and its size bound. The download
step needs the network and is not run here; the built-bundle test runs where a bundle was built."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import gpu_bundle as gb


def test_missing_distributions_are_those_the_image_lacks():
    got = gb.missing_distributions(["fastapi", "torch", "no_such_module_xyz"], {"torch"})
    assert got == {"fastapi": md.version("fastapi")}
    assert "numpy" in gb.image_packages() and "torch" in gb.image_packages()


def test_sglang_members_keep_the_llama_path_and_drop_the_rest():
    site = Path(md.distribution("sglang").locate_file(""))
    llama = site / "sglang/srt/models/llama.py"
    members = gb.sglang_members(site, {str(llama.resolve())})
    assert "sglang/srt/models/llama.py" in members and "sglang/srt/managers/scheduler.py" in members
    assert "sglang/srt/models/qwen2.py" not in members
    assert not [m for m in members if m.startswith(gb.EXCLUDED) or "__pycache__" in m]
    assert any(m.endswith(".dist-info/METADATA") for m in members)
    jit = [m for m in members if m.startswith(gb.JIT + "/")]
    assert any("/include/" in m for m in jit) and any("/csrc/" in m for m in jit)


def test_flashinfer_is_stripped_of_other_kernels_sources():
    keep = ["flashinfer/decode.py", "flashinfer/data/include/x.cuh", "flashinfer/data/csrc/a.cu"]
    drop = ["flashinfer/data/csrc/gemm/big.cu", "flashinfer/libx.so", "flashinfer/jit/t.json"]
    assert all(map(gb.flashinfer_member, keep)) and not any(map(gb.flashinfer_member, drop))
    assert gb.flashinfer_member("flashinfer_python-0.7.2.dist-info/METADATA")


def test_pack_is_atomic_and_the_size_check_names_the_largest(tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    size = gb.pack(bundle / "x.tar.xz", {"a/one.txt": b"hello" * 1000, "a/two.txt": b"x"})
    assert size == (bundle / "x.tar.xz").stat().st_size and not list(bundle.glob("*.part"))
    with tarfile.open(bundle / "x.tar.xz") as tar:
        assert tar.extractfile("a/one.txt").read() == b"hello" * 1000
    (bundle / "big.bin").write_bytes(os.urandom(4096))
    assert gb.check_size(bundle, limit=1 << 20) == sum(p.stat().st_size for p in bundle.iterdir())
    with pytest.raises(SystemExit, match="big.bin"):
        gb.check_size(bundle, limit=4096)


@pytest.mark.skipif(
    not (gb.BUNDLE / "manifest.json").exists(), reason="no .gpu_bundle built here (python -m benchmarks.gpu_bundle all)"
)
def test_built_bundle_fits_one_call_and_its_sglang_imports_the_llama_path(tmp_path):
    total = gb.check_size(gb.BUNDLE)
    manifest = json.loads((gb.BUNDLE / "manifest.json").read_text())
    assert manifest["wheels"] and (gb.BUNDLE / "sglang.tar.xz").exists() and (gb.BUNDLE / "tokenizer.tar.xz").exists()
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=gb.ROOT, capture_output=True, check=True).stdout
    tree = sum((gb.ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (gb.ROOT / p).is_file())
    assert total + tree < 64 << 20, f"bundle {total} + working tree {tree} bytes exceed one call's 64 MiB"
    with tarfile.open(gb.BUNDLE / "sglang.tar.xz") as tar:
        tar.extractall(tmp_path / "site", filter="data")
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(gb.ROOT)])}
    cmd = [sys.executable, "-m", "tests.gpu_standin.probe", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=gb.ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == {}
    assert report["sglang_files"] and all(f.startswith(str(tmp_path / "site")) for f in report["sglang_files"])
