"""A ``--model-path`` that names a GGUF file (or a folder holding one), checked and set up by the launcher.

On the CPU the file is served through SGLang's own GGUF path (``--load-format gguf`` and ``GGUFConfig``,
which SGLang picks for a ``.gguf`` model path) with this project's block kernels standing in for SGLang's
CUDA-only ones (:mod:`sgl_loopkv.models.gguf.weights`, :mod:`sgl_loopkv.models.decode_linear`). The
tokenizer and chat template come from the file's metadata (transformers' GGUF tokenizer converter), saved
once per file version as a tokenizer folder in the cache and given to SGLang as ``--tokenizer-path``:
SGLang 0.5.23 fails to load a tokenizer from a ``.gguf`` path itself when transformers returns its
generic ``TokenizersBackend`` (it looks the folder up on the Hub), and each of its processes would
parse the metadata again. Everything a start
cannot serve stops here, before SGLang loads anything, with a message naming the file: not GGUF,
truncated or corrupt, a tensor of a block type the kernels do not decode, an architecture other than
Llama's or Qwen2's, no tokenizer in the metadata. On a GPU the path is left to SGLang as it ships.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from sgl_loopkv.models.gguf.reader import GGUFError, GGUFFile
from sgl_loopkv.models.gguf.weights import ARCHITECTURES, LAYER_TENSORS


def gguf_file_of(model_path: str) -> Path | None:
    """The GGUF file a ``--model-path`` names: the path itself (``*.gguf``), or the one ``*.gguf`` of a
    folder that has no ``config.json`` (a folder with one is a Hugging Face model, which SGLang loads).
    A folder of several GGUF files is ambiguous: :class:`GGUFError`."""
    path = Path(model_path) if model_path else None
    if path is None:
        return None
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise GGUFError(f"{path} holds {len(files)} GGUF files ({names}): name one as --model-path")
        return files[0] if files else None
    return None


def check_servable(path: Path, own_tokenizer: bool) -> GGUFFile:
    """``path`` opened and checked for a CPU start (see the module docstring), or :class:`GGUFError`."""
    gguf = GGUFFile(path)  # every tensor's type, shape and extent
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: a {arch or 'unnamed'!r} model; sgl-loopkv serves GGUF files of Llama- and Qwen2-architecture "
            f"models (general.architecture {', '.join(ARCHITECTURES)}: Llama, Mistral, SmolLM, Qwen2) on the CPU"
        )
    layers = int(gguf.metadata(f"{arch}.block_count", 0))
    needed = ["token_embd.weight"] + [f"blk.{i}.{t}.weight" for i in range(layers) for t in LAYER_TENSORS]
    if missing := [n for n in needed if n not in gguf.tensors]:
        raise GGUFError(f"{path}: {len(missing)} tensors missing (first: {missing[0]}); not a whole {arch} model")
    if not own_tokenizer and gguf.metadata("tokenizer.ggml.model") is None:
        raise GGUFError(f"{path}: no tokenizer in its metadata; pass one with --tokenizer-path")
    return gguf


def tokenizer_folder(path: Path, cache_dir: Path) -> Path:
    """``path``'s tokenizer and chat template as a Hugging Face tokenizer folder under ``cache_dir``, made
    once per version of the file (its real path, size and modification time name the folder)."""
    st = path.stat()
    ident = json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns])
    folder = cache_dir / "gguf-tokenizers" / f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    except Exception as e:  # transformers' converters raise what they raise: the start stops with it named
        shutil.rmtree(tmp, ignore_errors=True)
        raise GGUFError(f"{path}: its tokenizer metadata cannot be read ({type(e).__name__}: {e})") from e
    try:
        os.replace(tmp, folder)  # whole or not at all
    except OSError:  # another start made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# SGLang 0.5.23 reads a GGUF model's metadata with ``gguf.GGUFReader`` (seconds for a large vocabulary:
# a numpy view per token) several times per process while it resolves its arguments and model config:
# once only for ``general.architecture``, again through transformers' ``load_gguf_checkpoint`` for the
# config, and twice in its GGUF loader. AROUND hooks read the architecture, the tensor names and the
# loader's weights from the header (this project's reader, ~0.1-0.5 s against 4-13 s for the default
# model's 49,152-token vocabulary), and make the config one parse per file version: kept in the process
# and as JSON in the cache folder, so the launcher's parse serves the scheduler process too.
ARCHITECTURE_TARGET = "sglang.srt.utils.hf_transformers.gguf_native.read_gguf_architecture"
CHECKPOINT_TARGET = "transformers.configuration_utils.load_gguf_checkpoint"
_CHECKPOINTS: dict[tuple, dict] = {}


def read_architecture(original, gguf_path, *args, **kwargs):
    """AROUND hook: ``general.architecture`` from the header alone (this project's reader)."""
    try:
        arch = GGUFFile(gguf_path).metadata("general.architecture")
    except (GGUFError, OSError):
        return original(gguf_path, *args, **kwargs)
    return arch if isinstance(arch, str) else None


def checkpoint_hook(cache_dir: Path | None):
    """The AROUND hook on transformers' ``load_gguf_checkpoint``: a metadata-only read (the config)
    parsed once per file version, in this process and (``cache_dir``) for every later process."""

    def load_checkpoint_once(original, gguf_path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original(gguf_path, return_tensors, *args, **kwargs)
        st = os.stat(gguf_path)
        key = (os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)
        if key not in _CHECKPOINTS:
            stored = _stored_checkpoint(cache_dir, key)
            found = stored.read() if stored else None
            if found is None:
                found = original(gguf_path, return_tensors=False)
                if stored:
                    stored.write(found)
            _CHECKPOINTS[key] = found
        return copy.deepcopy(_CHECKPOINTS[key])  # callers pop from and edit what they get

    return load_checkpoint_once


class _StoredCheckpoint:
    """One file version's metadata parse as JSON: written whole (a temporary file renamed) and read
    back only when it names the same file version and transformers version; anything else is a miss."""

    def __init__(self, path: Path, ident: list):
        self.path, self.ident = path, ident

    def read(self) -> dict | None:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return doc.get("checkpoint") if isinstance(doc, dict) and doc.get("ident") == self.ident else None

    def write(self, checkpoint: dict) -> None:
        try:
            text = json.dumps({"ident": self.ident, "checkpoint": checkpoint})
            if json.loads(text)["checkpoint"] != checkpoint:  # a tuple, a non-string key: not kept as it is
                return
        except (TypeError, ValueError):  # a value JSON cannot hold: the next process parses again
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache: each process parses, as without one


def _stored_checkpoint(cache_dir: Path | None, key: tuple) -> _StoredCheckpoint | None:
    if cache_dir is None:
        return None
    import transformers

    ident = [*key, transformers.__version__]
    name = f"{Path(key[0]).stem}-{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:12]}.json"
    return _StoredCheckpoint(Path(cache_dir) / "gguf-metadata" / name, ident)


EXTRA_NAMES_TARGET = "sglang.srt.model_loader.loader.get_gguf_extra_tensor_names"


def extra_tensor_names(original, gguf_file, gguf_to_hf_name_map):
    """AROUND hook: the mapped names the file has no tensor for (a tied LM head), from the header alone."""
    try:
        present = set(GGUFFile(gguf_file).tensors)
    except (GGUFError, OSError):
        return original(gguf_file, gguf_to_hf_name_map)
    return [hf for name, hf in gguf_to_hf_name_map.items() if name not in present]


WEIGHTS_TARGET = "sglang.srt.model_loader.loader.gguf_quant_weights_iterator"
#: packed MoE expert tensors, which SGLang's iterator splits per expert: such a file keeps SGLang's iterator
_PACKED_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def quant_weights(original, gguf_file, gguf_to_hf_name_map):
    """AROUND hook on SGLang's GGUF weight iterator: the same ``(name, tensor)`` pairs in the same order
    (every mapped block type as ``<name>.qweight_type``, then each tensor as a copy of the array
    ``gguf.GGUFReader`` gives it: float32/float16 values, other types' bytes per row), from the header
    alone instead of a ``GGUFReader`` parse of the whole metadata."""
    try:
        gguf = GGUFFile(gguf_file)
    except (GGUFError, OSError):
        return original(gguf_file, gguf_to_hf_name_map)
    if any(p in name for name in gguf.tensors for p in _PACKED_EXPERTS):
        return original(gguf_file, gguf_to_hf_name_map)
    return _weights(gguf, gguf_to_hf_name_map)


def _weights(gguf: GGUFFile, names: dict[str, str]):
    T = GGMLQuantizationType
    mapped = [(w, names[w.name]) for w in gguf.tensors.values() if w.name in names]  # the file's order
    for w, name in mapped:
        if w.qtype != T.F32:
            yield name.replace("weight", "qweight_type"), torch.tensor(w.qtype)
    for w, name in mapped:
        yield (name if w.qtype == T.F32 else name.replace("weight", "qweight")), torch.tensor(_reader_array(w))


def _reader_array(w):
    """The numpy array ``gguf.GGUFReader`` gives tensor ``w``: its values for float32 and float16, else its
    bytes, one row per row of the tensor."""
    T = GGMLQuantizationType
    raw = w.blocks.numpy()
    if w.qtype in (T.F32, T.F16):
        return raw.view(np.float32 if w.qtype == T.F32 else np.float16).reshape(w.shape)
    return raw.reshape(*w.shape[:-1], raw.shape[-1])
