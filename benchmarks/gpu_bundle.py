"""Build the files one GPU call carries for the in-server GPU check (issue 56): test infrastructure.

The GPU machine (device tool, ``nvidia-h200``) has Python 3.12, torch, Triton and transformers but no
SGLang, FlashInfer or sgl-kernel, no network, and takes at most 64 MiB per call (working tree
included). The bundle, in ``.gpu_bundle/`` (gitignored; ``carry`` it):

- ``sglang.tar.xz``: SGLang's Python sources from this venv, without the folders a Llama server never
  imports and with only the model files the probe saw loaded;
- ``wheels/``: the cp312 manylinux wheels of every package SGLang's Llama path imports that the
  image lacks (``gpu_image_packages.txt``), at this venv's versions;
- ``flashinfer.tar.xz`` (optional): FlashInfer's wheel stripped of other kernels' sources;
- ``tokenizer.tar.xz``: SmolLM2's tokenizer and chat template (the random-weight models' vocabulary);
- ``manifest.json``: what is in it and its size. The CUDA stand-in travels with the tree
  (``tests/gpu_standin``).

    python -m benchmarks.gpu_bundle probe      # import the Llama path under a pretended CUDA device
    python -m benchmarks.gpu_bundle download   # pip download the wheels (network; once)
    python -m benchmarks.gpu_bundle build      # pack; fails when over 60 MiB
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".gpu_bundle"
LIMIT_BYTES = 60 << 20  # the call's 64 MiB minus room for the working tree's growth
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
FLASHINFER = "flashinfer-python==0.7.2"  # the version SGLang 0.5.23 asserts
#: SGLang folders a Llama server never imports (the probe confirms: none of their files load).
EXCLUDED = ("sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/")
MODELS = "sglang/srt/models/"
JIT = "sglang/kernels/jit"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PIP_PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64") + tuple(
    f"manylinux_2_{n}_x86_64" for n in (24, 26, 27, 28, 31, 34, 35)
)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    lines = (x.strip() for x in path.read_text().splitlines())
    return {normalise(x) for x in lines if x and not x.startswith("#")}


def missing_distributions(modules: list[str], image: set[str]) -> dict[str, str]:
    """``{distribution: version}`` of this venv for the top-level ``modules`` whose distribution the
    image lacks. A module of no distribution (an extension inside another package) is skipped."""
    owners = md.packages_distributions()
    out = {}
    for module in modules:
        for dist in owners.get(module, ()):
            if normalise(dist) not in image:
                out[normalise(dist)] = md.version(dist)
    return dict(sorted(out.items()))


def sglang_members(site: Path, loaded: set[str]) -> list[str]:
    """Paths under ``site`` of the SGLang sources to carry: every ``.py`` outside ``EXCLUDED``; in
    ``srt/models`` only the files in ``loaded`` (absolute paths the probe saw) and ``__init__.py``;
    the JIT kernels' ``include``/``csrc`` (``sglang.kernels.jit`` refuses to import without them)."""
    out = []
    for path in sorted((site / JIT).rglob("*")):  # sources SGLang's JIT compiles, whose presence it checks at import
        rel = path.relative_to(site).as_posix()
        if path.is_file() and path.suffix != ".py" and "__pycache__" not in rel:
            out.append(rel)
    for path in sorted((site / "sglang").rglob("*.py")):
        rel = path.relative_to(site).as_posix()
        if "__pycache__" in rel or rel.startswith(EXCLUDED):
            continue
        if rel.startswith(MODELS) and path.name != "__init__.py" and str(path.resolve()) not in loaded:
            continue
        out.append(rel)
    dist = md.distribution("sglang")
    out += [f.as_posix() for f in dist.files if f.name == "METADATA"]  # importlib.metadata.version
    return out


def flashinfer_member(name: str) -> bool:
    """FlashInfer's wheel, stripped as benchmarks/gpu_device.sh describes: its Python, its dist-info,
    and ``data/`` (headers the JIT compiles against) without ``data/csrc``'s kernel sub-folders."""
    if name.startswith("flashinfer/data/"):
        return not re.match(r"flashinfer/data/csrc/[^/]+/", name)
    return name.endswith(".py") or ".dist-info/" in name


def pack(dest: Path, members: dict[str, bytes | Path], preset: int = 6) -> int:
    """Write ``members`` (archive name -> bytes or a file) to ``dest`` (tar.xz, atomically); bytes."""
    tmp = dest.with_suffix(".part")
    with tarfile.open(tmp, "w:xz", preset=preset) as tar:
        for name, src in members.items():
            data = src if isinstance(src, bytes) else Path(src).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(dest)
    return dest.stat().st_size


def bundle_bytes(bundle: Path) -> dict[str, int]:
    return {p.relative_to(bundle).as_posix(): p.stat().st_size for p in sorted(bundle.rglob("*")) if p.is_file()}


def check_size(bundle: Path, limit: int = LIMIT_BYTES) -> int:
    """Total bytes of the bundle; SystemExit naming the largest files when over ``limit``."""
    sizes = bundle_bytes(bundle)
    total = sum(sizes.values())
    if total > limit:
        top = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
        raise SystemExit(f"GPU bundle is {total / 2**20:.1f} MiB, over {limit / 2**20:.0f} MiB; largest: {top}")
    return total


def run_probe(bundle: Path) -> dict:
    out = bundle / "probe.json"
    cmd = [sys.executable, "-m", "tests.gpu_standin.probe", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    report = json.loads(out.read_text())
    if report["failed"]:
        raise SystemExit(f"the Llama path does not import under the CUDA stand-in: {report['failed']}")
    return report


def download(bundle: Path, report: dict) -> list[str]:
    wanted = missing_distributions(report["third_party"], image_packages())
    wheels = bundle / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    plats = [a for p in PIP_PLATFORMS for a in ("--platform", p)]
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
    pins = [f"{d}=={v}" for d, v in wanted.items()]
    subprocess.run([*base, "--python-version", "3.12", "--implementation", "cp", *plats, *pins], check=True)
    subprocess.run([*base, "--python-version", "3.12", "-d", str(bundle / "fi"), FLASHINFER], check=True)
    return pins


def build(bundle: Path, report: dict, model_dir: Path) -> dict:
    site = Path(md.distribution("sglang").locate_file(""))
    members = sglang_members(site, set(report["sglang_files"]))
    manifest = {"sglang": md.version("sglang"), "sglang_files": len(members)}
    manifest["sglang.tar.xz"] = pack(bundle / "sglang.tar.xz", {m: site / m for m in members})
    tok = {f"tokenizer/{n}": model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()}
    manifest["tokenizer.tar.xz"] = pack(bundle / "tokenizer.tar.xz", tok)
    fi = sorted((bundle / "fi").glob("flashinfer_python-*.whl"))
    if fi:
        with zipfile.ZipFile(fi[-1]) as z:
            kept = {n: z.read(n) for n in z.namelist() if not n.endswith("/") and flashinfer_member(n)}
        manifest["flashinfer.tar.xz"] = pack(bundle / "flashinfer.tar.xz", kept)
        fi[-1].unlink()  # 62 MiB: the stripped archive replaces it
    elif (bundle / "flashinfer.tar.xz").exists():  # stripped by an earlier build
        manifest["flashinfer.tar.xz"] = (bundle / "flashinfer.tar.xz").stat().st_size
    manifest["wheels"] = sorted(p.name for p in (bundle / "wheels").glob("*.whl"))
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1))
    manifest["total_bytes"] = check_size(bundle)
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("probe", "download", "build", "all"))
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--model-dir", type=Path, help="where the tokenizer comes from (default: the embedded model)")
    args = parser.parse_args()
    args.bundle.mkdir(parents=True, exist_ok=True)
    probe_file = args.bundle / "probe.json"
    if args.step in ("probe", "all") or not probe_file.exists():
        report = run_probe(args.bundle)
    else:
        report = json.loads(probe_file.read_text())
    if args.step in ("download", "all"):
        print("downloaded", download(args.bundle, report))
    if args.step in ("build", "all"):
        if args.model_dir is None:
            from sgl_loopkv.config import LoopKVConfig
            from sgl_loopkv.models import ensure_default_model

            args.model_dir = ensure_default_model(LoopKVConfig().resolved_cache_dir)
        manifest = build(args.bundle, report, args.model_dir)
        print(json.dumps({k: v for k, v in manifest.items() if k != "wheels"}))
        print(f"GPU bundle: {manifest['total_bytes'] / 2**20:.1f} MiB in {args.bundle}")


if __name__ == "__main__":
    main()
