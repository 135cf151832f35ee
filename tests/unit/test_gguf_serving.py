"""A GGUF ``--model-path`` on the CPU (``sgl_loopkv/models/gguf/serving.py``, the launcher's
``gguf_model_start``): a servable file becomes SGLang's model path, served from its blocks; anything it
cannot serve stops the start with a message naming the file (tests/e2e/test_gguf_weights.py serves one)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from sgl_loopkv.models.gguf import GGUFError
from sgl_loopkv.models.gguf.serving import check_servable, gguf_file_of, tokenizer_folder
from sgl_loopkv.server.launch import build_sglang_argv

LAYER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_model(path, arch: str = "llama", layers: int = 1, tokenizer: bool = True, skip: str = "") -> None:
    """A structurally whole (tiny, float32) GGUF model of ``arch`` for the launcher's checks."""
    writer = GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", layers)
    if tokenizer:
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_token_list(["<s>", "a", "b"])
    names = ["token_embd.weight"] + [f"blk.{i}.{t}.weight" for i in range(layers) for t in LAYER]
    for name in names:
        if name != skip:
            writer.add_tensor(name, np.zeros((4, 32), np.float32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_model_paths_are_recognised(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_file_of(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    assert gguf_file_of(str(tmp_path)) == tmp_path / "m.gguf"  # a folder holding one
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        gguf_file_of(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file_of(str(tmp_path)) is None  # a Hugging Face folder
    assert gguf_file_of(str(tmp_path / "config.json")) is None
    assert gguf_file_of("") is None and gguf_file_of("HuggingFaceTB/SmolLM2-135M") is None


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("gemma3", "a 'gemma3' model; sgl-loopkv serves GGUF files of Llama- and Qwen2-architecture"),
        ("missing", "1 tensors missing \\(first: blk.0.ffn_up.weight\\)"),
        ("no-tokenizer", "no tokenizer in its metadata; pass one with --tokenizer-path"),
        ("truncated", "truncated"),
        ("not-gguf", "not a readable GGUF file"),
    ],
)
def test_a_file_the_cpu_cannot_serve_is_named_with_the_reason(tmp_path, kind, match):
    path = tmp_path / "m.gguf"
    write_model(path, arch="gemma3" if kind == "gemma3" else "llama", tokenizer=kind != "no-tokenizer",
                skip="blk.0.ffn_up.weight" if kind == "missing" else "")  # fmt: skip
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    if kind == "not-gguf":
        path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GGUFError, match=match) as e:
        check_servable(path, own_tokenizer=False)
    assert str(path) in str(e.value)


def test_a_servable_file_becomes_sglangs_model_path_served_from_blocks(tmp_path):
    path = tmp_path / "tiny-q4.gguf"
    write_model(path, layers=2)
    own = ["--tokenizer-path", str(tmp_path), "--loopkv-device", "cpu"]  # this file's tokenizer is a stub
    config, argv, on_gpu = build_sglang_argv(["--model-path", str(tmp_path), *own])
    assert not on_gpu and config.weights == "gguf"
    assert argv[argv.index("--model-path") + 1] == str(path.resolve())  # the folder's one file
    assert argv[argv.index("--served-model-name") + 1] == "tiny-q4"
    _, named, _ = build_sglang_argv(["--model-path", str(path), "--served-model-name", "m", *own])
    assert named.count("--served-model-name") == 1 and named[named.index("--served-model-name") + 1] == "m"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "bf16"  # the GGUF path's default pool
    _, exact, _ = build_sglang_argv(["--model-path", str(path), "--kv-cache-dtype", "auto", *own])
    assert exact.count("--kv-cache-dtype") == 1 and exact[exact.index("--kv-cache-dtype") + 1] == "auto"


def test_the_tokenizer_and_chat_template_come_from_the_files_metadata(tmp_path):
    """The default model's GGUF file against the tokenizer of its converted folder (made from the same metadata)."""
    from transformers import AutoTokenizer

    from sgl_loopkv.config import default_cache_dir
    from sgl_loopkv.models import default_model_gguf, ensure_default_model

    folder = tokenizer_folder(default_model_gguf(), tmp_path)
    assert tokenizer_folder(default_model_gguf(), tmp_path) == folder  # made once
    ours, ref = (
        AutoTokenizer.from_pretrained(folder),
        AutoTokenizer.from_pretrained(ensure_default_model(default_cache_dir())),
    )
    chat = [{"role": "user", "content": "Où est la gare ? 42 + 7"}]
    assert ours.chat_template and ours.chat_template == ref.chat_template
    assert ours.apply_chat_template(chat, tokenize=True) == ref.apply_chat_template(chat, tokenize=True)
    assert ours.eos_token_id == ref.eos_token_id and len(ours) == len(ref)


@pytest.mark.parametrize(
    ("flags", "match"),
    [(["--loopkv-stock"], "GGUF kernels are CUDA-only"), (["--loopkv-weights", "float32"], "served from its blocks")],
)
def test_flags_that_cannot_serve_a_gguf_file_are_refused(tmp_path, flags, match):
    path = tmp_path / "m.gguf"
    write_model(path)
    with pytest.raises(SystemExit, match=match):
        build_sglang_argv(["--model-path", str(path), "--loopkv-device", "cpu", *flags])


def test_a_cpu_start_on_a_bad_gguf_file_exits_with_the_reason(tmp_path):
    model = tmp_path / "my.gguf"
    model.write_bytes(b"GGUF")
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_loopkv.launch_server", "--model-path", str(model), "--loopkv-device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert f"sgl-loopkv: {model}: not a GGUF file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_metadata_parse_is_kept_for_the_next_process(tmp_path, monkeypatch):
    """The launcher's parse, kept as JSON in the cache, is what a later process (an empty in-process
    memo) reads instead of parsing; a changed file version, a corrupt or foreign cache file and a value
    JSON would not keep as it is all parse again."""
    from sgl_loopkv.models.gguf import serving

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    calls = []

    def original(p, return_tensors=False):
        calls.append(p)
        return {"config": {"num_hidden_layers": 30, "rms_norm_eps": 1e-5}, "tokenizer": {"tokens": ["a", "b"]}}

    def new_process():
        monkeypatch.setattr(serving, "_CHECKPOINTS", {})
        return serving.checkpoint_hook(tmp_path / "cache")

    first = new_process()(original, str(gguf))
    assert new_process()(original, str(gguf)) == first and len(calls) == 1  # the second process read the file
    [kept] = (tmp_path / "cache" / "gguf-metadata").glob("*.json")
    kept.write_text("{not json")
    assert new_process()(original, str(gguf)) == first and len(calls) == 2  # corrupt: parsed (and rewritten)
    assert new_process()(original, str(gguf)) == first and len(calls) == 2
    os.utime(gguf, ns=(0, 12345))  # another version of the file: another entry
    new_process()(original, str(gguf))
    assert len(calls) == 3
    tupled = {"config": {"layer_types": ("full", "full")}}

    def with_a_tuple(p, return_tensors=False):
        calls.append(p)
        return tupled

    os.utime(gguf, ns=(0, 6789))
    new_process()(with_a_tuple, str(gguf))
    assert new_process()(with_a_tuple, str(gguf)) == tupled and len(calls) == 5  # not kept: never a list back


# the default model's case runs SGLang's own iterator, a GGUFReader parse of its 49,152-token vocabulary
# (10-40 s on 2 cores): slow; the mixed file's (every branch: float32, float16, blocks, unmapped) stays
@pytest.mark.parametrize("model", [pytest.param("default", marks=pytest.mark.slow), "mixed"])
def test_the_loaders_weights_from_the_header_are_sglangs(model, tmp_path):
    """The weight iterator hook yields SGLang's own iterator's pairs: names, order, dtypes, shapes, values
    (the default model's Q4_1 file; a file mixing float32, float16 and block tensors, unmapped ones left out)."""
    from sglang.srt.model_loader.weight_utils import gguf_quant_weights_iterator

    from sgl_loopkv.models import default_model_gguf
    from sgl_loopkv.models.gguf import serving

    if model == "default":
        path = str(default_model_gguf())
    else:
        path = str(tmp_path / "mixed.gguf")
        w = GGUFWriter(path, "llama")
        g = np.random.default_rng(0)
        w.add_tensor("a.weight", g.standard_normal((4, 64), dtype=np.float32))
        w.add_tensor("b.weight", g.standard_normal((3, 32)).astype(np.float16))
        w.add_tensor("c.weight", g.standard_normal(64, dtype=np.float32))
        w.add_tensor("skipped.weight", g.standard_normal(32, dtype=np.float32))
        from gguf import quants

        w.add_tensor(
            "d.weight", quants.quantize(g.standard_normal((2, 64), dtype=np.float32), T.Q8_0), raw_dtype=T.Q8_0
        )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    names = {n: f"model.{n}" for n in serving.GGUFFile(path).tensors if not n.startswith("skipped")}
    ours = list(serving.quant_weights(None, path, names))
    want = list(gguf_quant_weights_iterator(path, names))
    assert [n for n, _ in ours] == [n for n, _ in want] and len(ours) > len(names)
    for (n, a), (_, b) in zip(ours, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), n


def test_sglangs_metadata_reads_come_from_the_header_or_one_parse(tmp_path):
    from sgl_loopkv.models import default_model_gguf
    from sgl_loopkv.models.gguf import serving

    path = str(default_model_gguf())
    assert serving.read_architecture(lambda p: "slow", path) == "llama"
    assert serving.read_architecture(lambda p: "slow", str(tmp_path / "none.gguf")) == "slow"  # SGLang's own answer
    calls = []

    def original(p, return_tensors=False, *a):
        calls.append(return_tensors)
        return {"config": {"num_hidden_layers": 30}}

    load_checkpoint_once = serving.checkpoint_hook(None)
    first = load_checkpoint_once(original, path)
    first["config"].pop("num_hidden_layers")  # transformers edits what it gets
    assert load_checkpoint_once(original, path) == {"config": {"num_hidden_layers": 30}} and calls == [False]
    load_checkpoint_once(original, path, True)  # tensors: never cached
    assert calls == [False, True]
    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    assert serving.extra_tensor_names(None, path, names) == ["lm_head.weight"]  # tied: no output tensor
