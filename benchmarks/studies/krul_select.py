"""Krul pair selection on SmolLM2: I-R scores, estimator cost, and fidelity per (gamma, r_l, pairing, codec).

Offline in HF transformers (SDPA forward, queries/keys captured after RoPE): for a few synthetic
multi-turn chats (2K-4K tokens), the history's LayerStats come from the same estimator the loopkv
attention runs (``row_stats``, exact); the new turn is the last user message (+ assistant header).
Fidelity of a configuration: the history KV of every paired layer is replaced by its codec round
trip, then the new turn and the reference's 128 greedy tokens are fed (teacher forcing) and compared
with the unmodified cache: first-token KL(ref || shared) and greedy agreement (share of the 128
positions whose argmax is the reference token).

    flock /tmp/loopkv-bench.lock .venv/bin/python -m benchmarks.studies.krul_select
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.harness.env import environment
from benchmarks.harness.results import md_table
from benchmarks.studies import write_results
from sgl_loopkv.krul.codec import CODECS
from sgl_loopkv.krul.observer import KrulObserver
from sgl_loopkv.krul.pairing import ir_layers, max_pairs, select_pairs, total_distance
from sgl_loopkv.krul.similarity import row_stats

GAMMAS = [0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9]
RATIOS = [0.25, 0.5, 0.75, 1.0]
CODEC_SPECS = {"reuse": ("reuse", {}), "minicache": ("minicache", {}), "minicache_t0": ("minicache", {"t": 0.0})}
CONT = 128
IR_GAMMAS = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]

NAMES = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun"]
PLACES = ["library", "harbour", "museum", "station", "market", "observatory", "bakery", "school", "garden"]
THINGS = ["bridge repairs", "winter festival", "water supply", "new timetable", "budget", "rare maps", "choir"]


def chat(tokenizer, n_tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """A multi-turn chat of about ``n_tokens`` history tokens -> (history ids, new turn ids)."""
    rng = random.Random(seed)
    msgs, facts = [], []

    def encode(m, **kw):
        return tokenizer(tokenizer.apply_chat_template(m, tokenize=False, **kw), add_special_tokens=False)["input_ids"]

    def sentence():
        n, p, t = rng.choice(NAMES), rng.choice(PLACES), rng.choice(THINGS)
        return rng.choice(
            [
                f"{n} went to the {p} on a {rng.choice(['cold', 'bright', 'rainy'])} morning to ask about the {t}.",
                f"The {p} published a short note saying the {t} would be discussed again next month.",
                f"According to {n}, nobody at the {p} had expected so many questions about the {t}.",
                f"{n} wrote down {rng.randint(2, 99)} remarks about the {t} and left them at the {p}.",
            ]
        )

    while True:
        key = f"{rng.choice(PLACES)} code"
        val = str(rng.randint(10000, 99999))
        facts.append((key, val))
        body = " ".join(sentence() for _ in range(rng.randint(8, 14)))
        msgs.append({"role": "user", "content": f"{body} Note: the {key} is {val}. Summarise the story briefly."})
        msgs.append({"role": "assistant", "content": " ".join(sentence() for _ in range(3))})
        ids = encode(msgs)
        if len(ids) >= n_tokens:
            break
    key, _ = rng.choice(facts)
    new = msgs + [{"role": "user", "content": f"Thanks. Which number was the {key}? Then tell me who visited it."}]
    full = encode(new, add_generation_prompt=True)
    assert full[: len(ids)] == ids
    return list(ids), list(full[len(ids) :])


class Capture:
    """An HF attention implementation that records q/k (after RoPE) and runs SDPA."""

    def __init__(self):
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.on, self.q, self.k = False, {}, {}

        def fn(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
            if self.on:
                self.q[module.layer_idx] = query[0].transpose(0, 1).clone()  # [n, Hq, D]
                self.k[module.layer_idx] = key[0].transpose(0, 1).clone()  # [K, Hkv, D]
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
            )

        AttentionInterface.register("krul_bench", fn)
        AttentionMaskInterface.register("krul_bench", sdpa_mask)


def clone_cache(cache, replace: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
    from transformers import DynamicCache

    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        k, v = (replace or {}).get(i, (layer.keys, layer.values))
        out.update(k.clone(), v.clone(), i)
    return out


def round_trip(cache, pairs, codec) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per paired layer, its history K/V after encode/decode ([1, Hkv, T, D] like the HF cache)."""
    rep = {}
    for s, d in pairs:
        kv = [
            torch.stack([cache.layers[layer].keys[0], cache.layers[layer].values[0]]).transpose(1, 2)
            for layer in (s, d)
        ]
        row, side = codec.encode(kv[0], kv[1])
        for layer, x in zip((s, d), codec.decode(row, side)):
            x = x.transpose(1, 2).unsqueeze(1)  # [2, 1, Hkv, T, D]
            rep[layer] = (x[0].contiguous(), x[1].contiguous())
    return rep


def stored_fraction(pairs, codec_name, codec, cache, num_layers) -> float:
    """Stored bytes / full KV bytes of the history under this sharing (side data included)."""
    if not pairs:
        return 1.0
    per_layer = cache.layers[0].keys.numel() * 2 * cache.layers[0].keys.element_size()
    side = 0
    if codec_name != "reuse":
        for s, d in pairs:
            kv = [torch.stack([cache.layers[x].keys[0], cache.layers[x].values[0]]).transpose(1, 2) for x in (s, d)]
            side += codec.side_bytes(codec.encode(kv[0], kv[1])[1])
    return ((num_layers - len(pairs)) * per_layer + side) / (num_layers * per_layer)


def greedy(model, cache, new_ids, rep=None, n: int = CONT) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens after ``new_ids`` on a copy of ``cache`` (layers replaced by ``rep``), and
    the first token's logits [1, V]."""
    with torch.no_grad():
        tokens, c = [], clone_cache(cache, rep)
        logits = model(torch.tensor([new_ids]), past_key_values=c).logits[0, -1:]
        first = logits.float()
        for _ in range(n):
            tokens.append(int(logits[-1].argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=c).logits[0]
    return tokens, first


def fidelity(model, cache, new_ids, ref_tokens, ref_logits, rep) -> tuple[float, float]:
    x = torch.tensor([new_ids + ref_tokens[:-1]])
    with torch.no_grad():
        logits = model(x, past_key_values=clone_cache(cache, rep)).logits[0, len(new_ids) - 1 :].float()
    p = ref_logits[0].log_softmax(-1)
    kl = float((p.exp() * (p - logits[0].log_softmax(-1))).sum())
    agree = float((logits.argmax(-1) == torch.tensor(ref_tokens)).float().mean())
    return kl, agree


def adjacent_pairs(num_layers: int, ratio: float) -> list[tuple[int, int]]:
    """MiniCache's fixed strategy: adjacent pairs from the deepest layers down."""
    return [(num_layers - 2 - 2 * i, num_layers - 1 - 2 * i) for i in range(max_pairs(num_layers, ratio))]


def time_observer(cap, num_layers, scale, n_ctx, decode_steps=8) -> dict:
    """Estimator cost through the observer (the backend's calls) on a fake pool holding real keys:
    one decode row at ``n_ctx`` keys, and a 512-row extend at the end of ``n_ctx`` keys."""
    from types import SimpleNamespace

    from sgl_loopkv.attention.plan import build_dense_plan

    slots = n_ctx + 8
    pool = SimpleNamespace(k=[cap.k[layer][:n_ctx].contiguous() for layer in range(num_layers)])
    pool.get_key_buffer = lambda layer: pool.k[layer]
    r2t = torch.arange(slots, dtype=torch.int32)[None]
    out = {}
    for name, q_len in (("decode_step_s", 1), ("extend512_per_token_s", 512)):
        plan = build_dense_plan(r2t, [0], [n_ctx], [q_len])
        qs = [cap.q[layer][n_ctx - q_len : n_ctx] for layer in range(num_layers)]
        reps = decode_steps if q_len == 1 else 1
        observer = KrulObserver()
        observer.configure(True, num_layers)
        t0 = time.perf_counter()
        for _ in range(reps):
            for layer in range(num_layers):
                observer.record(layer, plan, [0], qs[layer], pool, scale)
        out[name] = (time.perf_counter() - t0) / reps / q_len
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 3072, 4096])
    ap.add_argument("--strides", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--gammas", type=float, nargs="+", default=GAMMAS)
    ap.add_argument("--ratios", type=float, nargs="+", default=RATIOS)
    ap.add_argument("--out", default="krul_select")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_loopkv.config import LoopKVConfig
    from sgl_loopkv.models import ensure_default_model

    path = ensure_default_model(LoopKVConfig().resolved_cache_dir)
    tok = AutoTokenizer.from_pretrained(path)
    cap = Capture()
    model = AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="krul_bench"
    ).eval()
    L = model.config.num_hidden_layers
    scale = (
        model.config.head_dim**-0.5
        if getattr(model.config, "head_dim", None)
        else (model.config.hidden_size // model.config.num_attention_heads) ** -0.5
    )
    convs, fid_rows, est_rows = [], [], []
    for ci, n in enumerate(args.lengths):
        hist, new = chat(tok, n, seed=ci)
        cap.on = True
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(torch.tensor([hist]), use_cache=True)
        prefill_s = time.perf_counter() - t0
        cap.on = False
        cache = out.past_key_values
        q = torch.stack([cap.q[layer] for layer in range(L)])
        keys = [cap.k[layer] for layer in range(L)]
        pos = torch.arange(len(hist))
        t0 = time.perf_counter()
        stats = row_stats(q, keys, pos, scale)
        exact_s = time.perf_counter() - t0
        est = {"tokens": len(hist), "model_prefill_s": prefill_s, "estimator_exact_s": exact_s}
        for st in args.strides:
            sel = pos[pos % st == 0]
            t0 = time.perf_counter()
            approx = row_stats(q[:, sel], keys, sel, scale, weight=st)
            est[f"estimator_stride{st}_s"] = time.perf_counter() - t0
            d0, d1 = stats.distance(), approx.distance()
            est[f"stride{st}_rel_dist_err"] = float((d1 - d0).abs().sum() / d0.abs().sum())
            est[f"stride{st}_same_greedy_pairs"] = select_pairs(approx, 0.5, 0.5) == select_pairs(stats, 0.5, 0.5)
        # decode step of the model at this length, and the observer's per-step / per-token cost
        with torch.no_grad():
            c2 = clone_cache(cache)
            t0 = time.perf_counter()
            for t in range(8):
                model(torch.tensor([[hist[-1 - t]]]), past_key_values=c2)
            est["model_decode_step_s"] = (time.perf_counter() - t0) / 8
        est.update(time_observer(cap, L, scale, len(hist)))
        est_rows.append(est)
        print(est, flush=True)

        ref_tokens, ref_first = greedy(model, cache, new)  # reference continuation
        ir = stats.ir_score().tolist()
        convs.append(
            {
                "tokens": len(hist),
                "new_tokens": len(new),
                "ir_score": ir,
                "ir_fraction": {g: len(ir_layers(stats, g)) / L for g in IR_GAMMAS},
                "distance": stats.distance().tolist(),
                "reference": tok.decode(ref_tokens[:48]),
            }
        )
        print("I-R", [round(x, 3) for x in ir], flush=True)
        codecs = {name: CODECS.create(c, **kw) for name, (c, kw) in CODEC_SPECS.items()}
        seen = {}
        configs = [(g, r, m) for g in args.gammas for r in args.ratios for m in ("greedy", "optimal")]
        configs += [("fixed", r, "adjacent") for r in args.ratios]
        for g, r, m in configs:
            pairs = adjacent_pairs(L, r) if m == "adjacent" else select_pairs(stats, g, r, m)
            for cname, codec in codecs.items():
                k = (tuple(sorted(pairs)), cname)
                if k not in seen:
                    kl, agree = fidelity(model, cache, new, ref_tokens, ref_first, round_trip(cache, pairs, codec))
                    seen[k] = (kl, agree, stored_fraction(pairs, cname, codec, cache, L))
                kl, agree, frac = seen[k]
                fid_rows.append(
                    {
                        "conv": ci,
                        "tokens": len(hist),
                        "gamma": g,
                        "ratio": r,
                        "pairing": m,
                        "codec": cname,
                        "pairs": pairs,
                        "n_pairs": len(pairs),
                        "total_distance": total_distance(stats.distance(), pairs),
                        "kl": kl,
                        "agreement": agree,
                        "stored_fraction": frac,
                    }
                )
        print(f"conv {ci}: {len(seen)} evaluations", flush=True)
    write(args.out, convs, fid_rows, est_rows, L)


def write(name, convs, fid_rows, est_rows, L):
    from collections import defaultdict

    groups = defaultdict(list)
    for r in fid_rows:
        groups[(r["gamma"], r["ratio"], r["pairing"], r["codec"])].append(r)
    table = []
    for (g, r, m, c), rows in groups.items():

        def mean(key, rows=rows):
            return sum(x[key] for x in rows) / len(rows)

        table.append(
            [
                g,
                r,
                m,
                c,
                mean("n_pairs"),
                mean("stored_fraction"),
                mean("kl"),
                mean("agreement"),
                min(x["agreement"] for x in rows),
            ]
        )
    md = ["# Krul pair selection on SmolLM2-135M (fp32, CPU)\n", "`python -m benchmarks.studies.krul_select`. Chats: "]
    md.append(", ".join(f"{c['tokens']} history + {c['new_tokens']} new tokens" for c in convs) + ".\n")
    md.append("\n## I-R score per layer (mean initial+recent mass per row and head)\n")
    md.append(
        md_table(
            ["layer"] + [f"chat {i}" for i in range(len(convs))],
            [[layer] + [c["ir_score"][layer] for c in convs] for layer in range(L)],
        )
    )
    md.append("\n## Fraction of I-R layers\n")
    md.append(
        md_table(
            ["gamma"] + [f"chat {i}" for i in range(len(convs))],
            [[g] + [c["ir_fraction"][g] for c in convs] for g in IR_GAMMAS],
        )
    )
    md.append("\n## Fidelity (means over chats; agreement = greedy top-1 agreement over 128 tokens)\n")
    md.append(
        md_table(
            [
                "gamma",
                "r_l",
                "pairing",
                "codec",
                "pairs",
                "stored/full",
                "KL first token",
                "agreement",
                "min agreement",
            ],
            table,
        )
    )
    md.append("\n## Estimator cost (seconds; 2 CPU cores shared)\n")
    keys = list(est_rows[0])
    md.append(md_table(keys, [[e[k] for k in keys] for e in est_rows]))
    write_results(
        "krul_select", {"env": environment(), "convs": convs, "fidelity": fid_rows, "estimator": est_rows}, "".join(md)
    )


if __name__ == "__main__":
    main()
