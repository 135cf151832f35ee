"""Serving a GGUF file: what exists and what does not yet (issue 53, step 4).

Built: the reader (:class:`~sgl_loopkv.models.gguf.reader.GGUFFile`), the block kernels
(:func:`~sgl_loopkv.models.gguf.linear.linear`), and ``--loopkv-weights gguf``
(:mod:`sgl_loopkv.models.gguf.weights`): the embedded default model, loaded from its converted folder,
has its linear layers and embedding served from its GGUF file's blocks with no float copy kept (CPU,
Llama, tensor parallelism 1). Not built: ``--model-path x.gguf`` served directly, i.e. the CPU
implementation of SGLang 0.5.23's GGUF path (``--load-format gguf``, ``GGUFConfig`` and the linear /
embedding methods of ``sglang/srt/layers/quantization/gguf.py``, whose kernels are CUDA-only), the
tokenizer and chat template from GGUF metadata, other architectures, int8-activation prefill, and a
llama.cpp comparison. Until then a CPU start on a GGUF model path stops here with a clear message
instead of failing inside SGLang's CUDA-only GGUF kernels.
"""

from __future__ import annotations

from pathlib import Path

NOT_BUILT = (
    "sgl-loopkv: serving a GGUF file on the CPU is not implemented yet (issue 53: the block kernels and the "
    "reader exist in sgl_loopkv.models.gguf; loading SGLang's GGUF model path through them does not). "
    "Serve a Hugging Face folder (safetensors + config.json) instead, or start without --model-path for the "
    "embedded default model."
)


def gguf_file_of(model_path: str) -> Path | None:
    """The GGUF file a ``--model-path`` names: the path itself (``*.gguf``), or the one ``*.gguf`` of a
    folder that has no ``config.json`` (a folder with one is a Hugging Face model, which SGLang loads)."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        return files[0] if files else None
    return None


def refuse_gguf_on_cpu(model_path: str) -> None:
    """Exit with :data:`NOT_BUILT` when ``model_path`` is a GGUF model (a CPU start)."""
    found = gguf_file_of(model_path)
    if found is not None:
        raise SystemExit(f"{NOT_BUILT} (model path: {found})")
