"""Restoration scheduler: plans are valid under any cost model and pick the right extreme when one
stream is cheap; the front recompute reproduces a full prefill's KV for any split (with and
without a device prefix); the model-driven stack matches HF's layers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from sgl_loopkv.restore.config import RestoreConfig
from sgl_loopkv.restore.plan import (
    PLANNERS,
    CostModel,
    KrulPlanner,
    RestoreJob,
    RestorePlan,
    finish_times,
    load_all_is_optimal,
    pyramid,
    simulate,
)
from sgl_loopkv.restore.recompute import LayerStack, recompute_front
from tests.fakes import tiny_llama

SMOL = dict(num_layers=30, layer_bytes=2 * 3 * 64 * 4)


def job(total=4096, **kw) -> RestoreJob:
    return RestoreJob(total=total, **{**SMOL, **kw})


def planners():
    return [PLANNERS.create(n) for n in PLANNERS.names() if n != "fixed"] + [
        PLANNERS.create("fixed", RestoreConfig(ratio=r)) for r in (0.0, 0.3, 1.0)
    ]


def test_every_plan_is_non_increasing_and_chunk_aligned():
    rng = random.Random(0)
    for _ in range(60):
        j = job(
            total=16 * rng.randint(1, 400),
            prefix=16 * rng.randint(0, 100),
            new_tokens=rng.randint(1, 300),
            disk_tokens=0,
            num_layers=rng.choice([2, 12, 30]),
        )
        cost = CostModel(
            token_s=10 ** rng.uniform(-7, -3),
            attn_s=10 ** rng.uniform(-11, -7),
            copy_bps=10 ** rng.uniform(7, 11),
            disk_bps=10 ** rng.uniform(7, 10),
        )
        for p in planners():
            plan = p.plan(j, cost)
            assert plan.total == j.total and plan.num_layers == j.num_layers
            assert all(b <= a for a, b in zip(plan.recompute, plan.recompute[1:])), (type(p).__name__, plan)
            assert all(s % 16 == 0 or s == j.total for s in plan.recompute)


def test_invalid_plans_are_rejected():
    with pytest.raises(ValueError, match="non-increasing"):
        RestorePlan(64, (16, 32))
    with pytest.raises(ValueError):
        RestorePlan(64, (80, 0))


def test_planner_chooses_the_cheap_stream():
    j = job(new_tokens=64)
    cheap_compute = CostModel(token_s=1e-12, attn_s=1e-18, copy_bps=1e8)
    assert KrulPlanner().plan(j, cheap_compute) == RestorePlan.recompute_all(j.total, j.num_layers)
    cheap_load = CostModel(token_s=1e-3, attn_s=1e-7, copy_bps=1e12)
    assert KrulPlanner().plan(j, cheap_load) == RestorePlan.load_all(j.total, j.num_layers)


def test_fixed_layer_costs_keep_the_planner_from_marginal_recomputes():
    """Copying is only slightly slower than recomputing: without a per-layer call cost a small
    front recompute looks worth it; with a realistic one (a few ms a layer on a CPU) load-all wins."""
    j = job(new_tokens=16)
    per_token = j.layer_bytes / 1e10
    free_calls = CostModel(token_s=per_token * 3, attn_s=0.0, copy_bps=1e10)
    assert KrulPlanner().plan(j, free_calls).recompute_tokens > 0
    costly_calls = CostModel(token_s=per_token * 3, attn_s=0.0, copy_bps=1e10, layer_s=5e-3)
    assert KrulPlanner().plan(j, costly_calls) == RestorePlan.load_all(j.total, j.num_layers)


def test_planner_balances_equal_streams_and_beats_both_extremes():
    j = job(new_tokens=64)
    # One token-layer costs the same to recompute and to copy: the best split shares the work.
    per_token = j.layer_bytes / 1e9
    cost = CostModel(token_s=per_token, attn_s=0.0, copy_bps=1e9)
    plan = KrulPlanner().plan(j, cost)
    assert 0.2 < plan.recompute_fraction < 0.8
    t = simulate(plan, j, cost)
    for extreme in (RestorePlan.load_all(j.total, 30), RestorePlan.recompute_all(j.total, 30)):
        assert t.finish_s < 0.7 * simulate(extreme, j, cost).finish_s
    assert t.bubble_fraction < 0.1


def test_planner_never_loses_to_its_candidates():
    rng = random.Random(1)
    for _ in range(20):
        j = job(total=16 * rng.randint(10, 300), new_tokens=rng.randint(1, 200), disk_tokens=0)
        cost = CostModel(token_s=10 ** rng.uniform(-7, -4), attn_s=1e-9, copy_bps=10 ** rng.uniform(8, 10))
        best = simulate(KrulPlanner().plan(j, cost), j, cost).finish_s
        for top in (0, j.total // 4, j.total):
            assert best <= simulate(pyramid(j, top, 0), j, cost).finish_s + 1e-12


def test_the_planners_array_timeline_is_simulate_for_every_candidate():
    """The planner times its candidates together (finish_times): each must equal simulate's finish,
    or the plan it picks is the optimum of another model than the one the docs describe."""
    rng = random.Random(2)
    planner = KrulPlanner()
    for _ in range(30):
        total = 16 * rng.randint(1, 500)
        j = job(
            total=total,
            num_layers=rng.choice([1, 4, 30]),
            prefix=rng.choice([0, 160]),
            new_tokens=rng.randint(1, 900),
            disk_tokens=rng.choice([0, total // 2, total]),
            stored_layer_bytes=rng.choice([None, 400.0]),
        )
        cost = CostModel(
            token_s=10 ** rng.uniform(-7, -3),
            attn_s=10 ** rng.uniform(-11, -7),
            layer_s=rng.choice([0.0, 1e-4]),
            copy_bps=10 ** rng.uniform(8, 10.5),
            disk_bps=10 ** rng.uniform(8, 10),
        )
        cands = planner.candidates(j)
        assert (cands[0] == 0).all() and (cands == j.total).all(1).any()  # load-all and recompute-all
        got = finish_times(cands, j, cost)
        for row, t in zip(cands, got):
            plan = RestorePlan(j.total, tuple(int(x) for x in row))  # valid: non-increasing, chunk-aligned
            assert t == pytest.approx(simulate(plan, j, cost).finish_s, rel=1e-9, abs=1e-15)
        assert simulate(planner.plan(j, cost), j, cost).finish_s == pytest.approx(min(got), rel=1e-9, abs=1e-15)


def test_load_all_is_decided_without_simulation_only_where_the_simulation_agrees():
    """Loads before the forward (a CPU pool): where a token-layer's load is cheaper than any
    recompute of it, the planner returns load-all without simulating; that must be the simulated
    optimum (no candidate finishes earlier), and overlapped loads never take the shortcut."""
    rng = random.Random(3)
    planner, decided = KrulPlanner(), 0
    for _ in range(200):
        total = 16 * rng.randint(1, 300)
        j = job(
            total=total,
            num_layers=rng.choice([2, 30]),
            prefix=rng.choice([0, 160, 2048]),
            new_tokens=rng.randint(1, 300),
            disk_tokens=rng.choice([0, total]),
            overlapped=False,
        )
        cost = CostModel(
            token_s=10 ** rng.uniform(-7, -4),
            attn_s=10 ** rng.uniform(-11, -8),
            layer_s=rng.choice([0.0, 1e-4]),
            copy_bps=10 ** rng.uniform(7, 10.5),
            disk_bps=10 ** rng.uniform(7, 10),
        )
        if load_all_is_optimal(j, cost):
            decided += 1
            t = finish_times(planner.candidates(j), j, cost)
            assert t[0] <= t.min() * (1 + 1e-12), (j, cost)
            assert planner.plan(j, cost) == RestorePlan.load_all(j.total, j.num_layers)
        assert not load_all_is_optimal(replace(j, overlapped=True), cost)
    assert 20 < decided < 180  # both branches taken


def test_disk_reads_only_what_is_loaded():
    j = job(disk_tokens=4096)
    cost = CostModel(disk_bps=1e8)
    load_all = simulate(RestorePlan.load_all(4096, 30), j, cost)
    half = simulate(RestorePlan(4096, (2048,) * 30), j, cost)
    assert half.load_s == pytest.approx(load_all.load_s / 2, rel=1e-6)


# --- recompute vs a full prefill, on HF's own layers ------------------------------------------
class HFLayerStack(LayerStack):
    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.m, self.rope = model.model, apply_rotary_pos_emb
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.d**-0.5

    def embed(self, ids):
        return self.m.embed_tokens(ids)

    def qkv(self, layer, x, positions):
        blk = self.m.layers[layer]
        a, n = blk.self_attn, x.shape[0]
        h = blk.input_layernorm(x)
        q = a.q_proj(h).view(n, self.hq, self.d).transpose(0, 1)[None]
        k = a.k_proj(h).view(n, self.hkv, self.d).transpose(0, 1)[None]
        v = a.v_proj(h).view(n, self.hkv, self.d)
        cos, sin = self.m.rotary_emb(x[None], positions[None])
        q, k = self.rope(q, k, cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v

    def attention(self, q, k, v):
        from sgl_loopkv.attention.executor import dense_attention

        return dense_attention(q, k, v, self.scale)

    def finish(self, layer, x, attn):
        blk = self.m.layers[layer]
        x = x + blk.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        return x + blk.mlp(blk.post_attention_layernorm(x))


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_llama(5, vocab_size=300, attn_implementation="eager")


def full_kv(model, ids):
    with torch.no_grad():
        pkv = model(ids[None], use_cache=True).past_key_values
    return [(pkv.layers[i].keys[0].transpose(0, 1), pkv.layers[i].values[0].transpose(0, 1)) for i in range(5)]


@pytest.mark.parametrize("start", [0, 48])
def test_recompute_front_equals_full_prefill_for_any_split(tiny_hf, start):
    ids = torch.randint(0, 300, (start + 160,), generator=torch.Generator().manual_seed(2))
    ref = full_kv(tiny_hf, ids)
    stack = HFLayerStack(tiny_hf)
    total = 160
    plans = [
        RestorePlan.recompute_all(total, 5),
        RestorePlan(total, (160, 128, 64, 64, 16)),
        RestorePlan(total, (96,) * 5),
        RestorePlan(total, (32, 32, 0, 0, 0)),
        RestorePlan.load_all(total, 5),
    ]
    for plan in plans:
        got: dict[int, tuple] = {}
        recompute_front(
            stack,
            plan,
            ids[start:],
            start,
            lambda layer, k, v, got=got: got.__setitem__(layer, (k, v)),
            lambda layer: (ref[layer][0][:start], ref[layer][1][:start]),
        )
        for layer in range(5):
            s = plan.recompute[layer]
            if s == 0:
                assert layer not in got
                continue
            k, v = got[layer]
            assert k.shape[0] == s
            torch.testing.assert_close(k, ref[layer][0][start : start + s], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(v, ref[layer][1][start : start + s], atol=2e-5, rtol=1e-4)
