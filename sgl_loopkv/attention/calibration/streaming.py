"""Calibrating LServe's streaming heads for one model: the procedure behind the JSON files here.

LServe reuses DuoAttention's per-head gates, trained by gradient descent for ~2000 steps on GPUs.
On a CPU we measure the question those gates answer directly, without training: does this head
need keys outside its streaming window?

1. Build ``prompts`` synthetic passkey-retrieval prompts of ~``tokens`` tokens (seeded): filler
   sentences with ``needles`` facts "The pass key of door X is NNNNN." at random depths, then, for
   each fact, "Question: what is the pass key of door X? Answer: the pass key of door X is". The
   question rows are where retrieval heads have to look far back.
2. Prefill each prompt with the Hugging Face model in fp32 and keep every layer's post-RoPE q and k
   (:mod:`.capture`).
3. For each (layer, KV head), on the question rows plus ``random_rows`` random rows of the prompt's
   second half: exact causal attention (mean over the GQA group), and the mass that falls outside
   the block-granular streaming pattern served later (``sink`` tokens + ``local`` tokens before the
   diagonal block of ``block_size``).
4. Retrieval score = that outside mass, averaged over rows and prompts. The lowest scores are the
   heads that lose least when they stream.

The JSON keeps the scores and every parameter above, so each file says how it was made.
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import UTC, datetime
from pathlib import Path

import torch

from sgl_loopkv.attention.calibration import calibration_path
from sgl_loopkv.attention.calibration.capture import capture_qkv, load_capturing_model
from sgl_loopkv.attention.sampled import sampled_attention

_WORDS = (
    "the a river city morning report council water bridge market season letter garden road winter museum "
    "station harbour festival library engine signal forest valley summer teacher window history number walked "
    "quietly under over near old new small large green blue red bright dark early late"
).split()


def build_prompt(tokenizer, tokens: int, needles: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(input ids, positions of the question rows) of one passkey-retrieval prompt."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    facts = [(rng.randrange(100, 1000), rng.randrange(10000, 100000)) for _ in range(needles)]
    questions = [
        enc(f"\nQuestion: what is the pass key of door {d}? Answer: the pass key of door {d} is") for d, _ in facts
    ]
    budget = tokens - sum(len(q) for q in questions)
    depths = sorted(rng.sample(range(budget), needles))
    ids: list[int] = []
    for d, key in facts:
        target = depths.pop(0)
        while len(ids) < target:
            ids += enc(" " + " ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ".")
        ids += enc(f" The pass key of door {d} is {key}. Remember it.")
    while len(ids) < budget:
        ids += enc(" " + " ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ".")
    ids = ids[:budget]
    rows = []
    for q in questions:
        rows += range(len(ids), len(ids) + len(q))
        ids += q
    return ids, rows


def outside_mass(q, k, scale: float, rows: torch.Tensor, sink: int, local: int, block_size: int) -> torch.Tensor:
    """Per KV head, the mean attention mass of ``rows`` outside the streaming pattern -> [Hkv]."""
    attn = sampled_attention(q[rows], k, rows, scale)  # [H, s, L]
    B, L = block_size, k.shape[0]
    qb, kb = (rows // B)[:, None], (torch.arange(L) // B)[None, :]
    inside = (kb < sink // B) | (qb - kb <= local // B)
    return 1.0 - (attn * inside).sum(-1).mean(-1)


def calibrate(
    model_dir: str | Path,
    tokens: int = 3072,
    prompts: int = 4,
    needles: int = 4,
    sink: int = 64,
    local: int = 512,
    block_size: int = 64,
    random_rows: int = 64,
    seed: int = 0,
) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_capturing_model(model_dir)
    rng = random.Random(seed)
    total = None
    for _ in range(prompts):
        ids, question_rows = build_prompt(tokenizer, tokens, needles, rng)
        second_half = rng.sample(range(len(ids) // 2, question_rows[0]), random_rows)
        rows = torch.tensor(sorted(set(question_rows) | set(second_half)))
        layers, _ = capture_qkv(model, ids)
        scores = torch.stack([outside_mass(x.q, x.k, x.scale, rows, sink, local, block_size) for x in layers])
        total = scores if total is None else total + scores
    scores = total / prompts
    return {
        "model": Path(model_dir).name,
        "num_layers": scores.shape[0],
        "num_kv_heads": scores.shape[1],
        "retrieval_scores": [[round(float(x), 6) for x in row] for row in scores],
        "procedure": "sgl_loopkv.attention.calibration.streaming (see its docstring)",
        "params": {
            "tokens": tokens,
            "prompts": prompts,
            "needles": needles,
            "sink": sink,
            "local": local,
            "block_size": block_size,
            "random_rows": random_rows,
            "seed": seed,
        },
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(
        prog="python -m sgl_loopkv.attention.calibration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-path", required=True, help="local Hugging Face model folder")
    ap.add_argument("--out", help="output JSON (default: this package's <model folder name>.json)")
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    result = calibrate(args.model_path, tokens=args.tokens, prompts=args.prompts, seed=args.seed)
    out = Path(args.out) if args.out else calibration_path(result["model"])
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return out
