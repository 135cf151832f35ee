"""A Qwen2 GGUF file on the CPU (issue 53: the llama-family architectures SGLang's GGUF loader maps): a
tiny random-weight Qwen2 written with the ``gguf`` package (Q4_1, Q4_0 and Q8_0 blocks, float32 q/k/v
biases, a tied embedding, the default model's tokenizer metadata) served from its blocks on the exact path
(float32 pool and prefills) gives the greedy tokens of a plain transformers forward over its float32
conversion (transformers' GGUF loader, as the default model's), and logprobs within float32 rounding of it:
only the order of float32 sums differs. Qwen2's q/k rows are stored as Hugging Face orders them (llama.cpp
permutes Llama's only): served permuted, the attention would differ and so would the tokens. One server,
the reference in this process: a second server beside the session's shared ones ran the suite's machine
out of memory."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants

from benchmarks.common import metrics
from sgl_loopkv.server.process import ServerProcess
from tests.e2e.conftest import COMMON_SERVER_ARGS
from tests.e2e.test_gguf_weights import greedy

pytestmark = pytest.mark.server

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def _tokenizer_fields(writer: GGUFWriter, source: Path) -> int:
    """The tokenizer and chat template of ``source`` (a GGUF file) into ``writer``; returns the vocabulary size."""
    f = GGUFReader(source).fields

    def text(key, i=-1):
        return bytes(f[key].parts[i]).decode()

    writer.add_tokenizer_model(text("tokenizer.ggml.model"))
    tokens = [text("tokenizer.ggml.tokens", i) for i in f["tokenizer.ggml.tokens"].data]
    writer.add_token_list(tokens)
    writer.add_token_types(
        [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    )
    writer.add_token_merges([text("tokenizer.ggml.merges", i) for i in f["tokenizer.ggml.merges"].data])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        add(int(f[f"tokenizer.ggml.{key}_token_id"].parts[-1][0]))
    writer.add_chat_template(text("tokenizer.chat_template"))
    return len(tokens)


def write_qwen2(path: Path, tokenizer_from: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "qwen2")
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    vocab = _tokenizer_fields(w, tokenizer_from)
    d = HIDDEN // HEADS

    def tensor(name, shape, qtype, scale=0.25, around=0.0):
        a = (around + scale * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, a if qtype == T.F32 else quants.quantize(a, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (vocab, HIDDEN), T.Q8_0, scale=0.05)  # tied: the LM head too
    tensor("output_norm.weight", (HIDDEN,), T.F32, 0.1, 1.0)
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", (HIDDEN,), T.F32, 0.1, 1.0)
        tensor(b + "ffn_norm.weight", (HIDDEN,), T.F32, 0.1, 1.0)
        tensor(b + "attn_q.weight", (HEADS * d, HIDDEN), T.Q4_1)
        tensor(b + "attn_k.weight", (KV_HEADS * d, HIDDEN), T.Q4_1)
        tensor(b + "attn_v.weight", (KV_HEADS * d, HIDDEN), T.Q8_0)
        for n, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            tensor(b + f"attn_{n}.bias", (rows * d,), T.F32, 0.1)
        tensor(b + "attn_output.weight", (HIDDEN, HEADS * d), T.Q4_0)
        tensor(b + "ffn_gate.weight", (FFN, HIDDEN), T.Q4_1)
        tensor(b + "ffn_up.weight", (FFN, HIDDEN), T.Q4_1)
        tensor(b + "ffn_down.weight", (HIDDEN, FFN), T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert(gguf_path: Path, out: Path) -> None:
    """The float32 Hugging Face checkpoint of ``gguf_path`` (transformers' GGUF loader)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized already; transformers refuses to save a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, server_logs):
    """(the GGUF server, the float32 conversion's folder)."""
    from sgl_loopkv.models import default_model_gguf

    root = tmp_path_factory.mktemp("qwen2")
    path = root / "tiny-qwen2.gguf"
    write_qwen2(path, default_model_gguf())
    convert(path, root / "float32")
    args = [*COMMON_SERVER_ARGS[2:], "--max-total-tokens", "2048", "--kv-cache-dtype", "auto"]
    args += ["--loopkv-prefill-dtype", "float32", "--enable-metrics"]
    srv = ServerProcess(["--model-path", str(path), *args], log_path=server_logs / "qwen2-gguf.log")
    with srv.start():
        yield srv, root / "float32"


def reference(folder: Path, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs from a plain transformers forward in float32 (no KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x, out, lps = torch.tensor([ids]), [], []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(x).logits[0, -1].double(), -1)
            nxt = int(logp.argmax())
            out.append(nxt)
            lps.append(float(logp[nxt]))
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out, lps


def test_a_qwen2_gguf_file_serves_what_its_float32_conversion_computes(qwen2):
    srv, folder = qwen2
    rng = random.Random(2)
    for n in (20, 300):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        got = greedy(srv.url, ids, n=16)
        want, want_lp = reference(folder, ids, 16)
        assert got["ids"] == want, n
        assert len(set(want)) > 4, want  # the layers move the answer (not one token repeated)
        assert max(abs(x - y) for x, y in zip(got["logprobs"], want_lp)) < 2e-3, n
    m = metrics(srv.url)  # the tied embedding and 2 layers of qkv, o, gate+up, down
    assert m.get("loopkv_gguf_layers") == 1 + 4 * LAYERS, m
