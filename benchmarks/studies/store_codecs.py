"""Fidelity of the tiers' stored dtypes on SmolLM2, offline in HF transformers: the history KV of
every layer is round-tripped through a codec (bf16, fp16, int8 as ``--loopkv-tier-store-dtype int8``
stores it, and int4 for scale), then the new turn and the reference's 128 greedy tokens are fed.

Reported per history length: first-token KL(fp32 || codec), teacher-forced top-1 agreement over the
128 reference positions, prefix agreement (share of the codec's own 128 greedy tokens before the
first divergence), and stored bytes per token and layer (scales included, summaries not).

    python -m benchmarks.studies.store_codecs
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.studies import write_results
from benchmarks.studies.krul_select import CONT, chat, fidelity, greedy
from sgl_loopkv.cache.layout import KVGeometry
from sgl_loopkv.cache.quant import QuantKV


def int4(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True) / 7
    return (x / s.clamp_min(1e-30)).round().clamp(-7, 7) * s


def int8(x: torch.Tensor) -> torch.Tensor:
    """As the int8 tier: x [1, H, T, D] (HF layout) -> per (token, head) scales over D."""
    q = QuantKV.quantize(x.transpose(1, 2))  # [1, T, H, D]: the same per-(token, head) grouping
    return q[0].unsqueeze(0).transpose(1, 2)


CODECS = {
    "bfloat16": (lambda x: x.bfloat16().float(), torch.bfloat16),
    "float16": (lambda x: x.half().float(), torch.float16),
    "int8": (int8, torch.int8),
    "int4 (not offered)": (int4, None),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import ensure_default_model

    path = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    rows, out = [], []
    for n in args.lengths:
        hist, new = chat(tok, n, seed=n)
        with torch.no_grad():
            cache = model(torch.tensor([hist]), use_cache=True).past_key_values
        ref, first = greedy(model, cache, new)
        for name, (fn, dtype) in CODECS.items():
            rep = {i: (fn(layer.keys), fn(layer.values)) for i, layer in enumerate(cache.layers)}
            kl, agree = fidelity(model, cache, new, ref, first, rep)
            own, _ = greedy(model, cache, new, rep)
            prefix = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), CONT) / CONT
            geo = KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, dtype or torch.int8, 16)
            nbytes = geo.token_bytes_per_layer if dtype else 2 * geo.num_kv_heads * (32 + 4)
            out.append({"tokens": len(hist), "codec": name, "kl": kl, "agreement": agree, "prefix": prefix})
            rows.append([len(hist), name, nbytes, kl, agree, prefix])
            print(rows[-1], flush=True)
    md = (
        "# Stored-dtype fidelity on SmolLM2-135M (`python -m benchmarks.studies.store_codecs`)\n\n"
        "Every layer's history KV round-tripped through the codec; fp32 KV is the reference (1536 bytes per token "
        "and layer). Agreement is over 128 greedy reference tokens.\n\n"
        + md_table(
            [
                "history tokens",
                "codec",
                "bytes/token/layer",
                "first-token KL",
                "top-1 agreement (teacher-forced)",
                "prefix agreement",
            ],
            rows,
        )
    )
    write_results("store_codecs", {"summary": {"rows": out}, "env": environment()}, md)
    print(md)


if __name__ == "__main__":
    main()
