"""Import SGLang's Llama serving path as a CUDA machine would, on any machine (test infrastructure).

``python -m tests.gpu_standin.probe [--out file.json] [module ...]`` pretends a CUDA device is present
(``torch.cuda.is_available`` and the device queries SGLang makes at import time), puts the CUDA
stand-in for ``sgl_kernel`` first on ``sys.path``, imports the modules (default ``LLAMA_PATH``) and
prints a JSON report: which imported and which failed (with the error), the stand-in's submodules
SGLang loaded, the SGLang files loaded, and the third-party top-level packages loaded (what a GPU
machine must have or be carried). Import-time only: no CUDA kernel runs, so a pass says the names
resolve, not that the GPU path computes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from tests.gpu_standin import STANDIN_DIR

#: What ``python -m sgl_loopkv.launch_server`` imports on CUDA for a Llama model, in SGLang's
#: processes (HTTP, tokenizer, scheduler, detokenizer) and our plugin.
LLAMA_PATH = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.llama",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.memory_pool",
    "sgl_loopkv.plugin",
    "sgl_loopkv.attention.backend",
    "sgl_loopkv.attention.decode_gpu",
    "sgl_loopkv.attention.sparse.flashinfer",
)
#: Needs FlashInfer installed (carried on the GPU machine); probed only where it imports.
FLASHINFER_PATH = ("sglang.srt.layers.attention.flashinfer_backend",)


class _FakeProps:
    name, major, minor = "NVIDIA H200 (probe)", 9, 0
    total_memory, multi_processor_count, L2_cache_size = 140 << 30, 132, 60 << 20


def pretend_cuda() -> None:
    """Make ``torch.cuda`` answer SGLang's import-time questions as one Hopper GPU would."""
    import os

    import torch

    # a CUDA machine has no CPU-engine switch; one inherited from a CPU process (the test suite sets
    # it) would make SGLang import its CPU kernels from the CUDA stand-in
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    if torch.version.cuda is None:
        torch.version.cuda = "13.0"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: _FakeProps()
    torch.cuda.get_device_name = lambda *a, **k: _FakeProps.name


def probe(modules: tuple[str, ...]) -> dict:
    before = set(sys.modules)
    pretend_cuda()
    sys.path.insert(0, str(STANDIN_DIR))
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]  # a CPU stand-in imported earlier in this process
    ok, failed = [], {}
    for name in modules:
        try:
            importlib.import_module(name)
            ok.append(name)
        except Exception as e:  # report every failure, not only the first
            failed[name] = f"{type(e).__name__}: {e}"[:500]
    kernel = sys.modules.get("sgl_kernel")
    third_party, sglang_files = set(), set()
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or name in before and not name.startswith(("sglang", "sgl_")):
            continue
        top, p = name.partition(".")[0], Path(path).resolve()
        if top == "sglang":
            sglang_files.add(str(p))
        elif "site-packages" in p.parts:
            third_party.add(top)
    return {
        "ok": ok,
        "failed": failed,
        "standin": bool(getattr(kernel, "IS_SGL_LOOPKV_STANDIN", False)),
        "standin_modules": sorted(m for m in sys.modules if m.startswith("sgl_kernel")),
        "sglang_files": sorted(sglang_files),
        "third_party": sorted(third_party - {"sglang", "sgl_kernel", "sgl_loopkv"}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modules = tuple(args.modules) or LLAMA_PATH + tuple(
        m for m in FLASHINFER_PATH if importlib.util.find_spec("flashinfer") is not None
    )
    report = json.dumps(probe(modules), indent=1)
    if args.out:
        args.out.write_text(report)
    else:
        print(report)


if __name__ == "__main__":
    main()
