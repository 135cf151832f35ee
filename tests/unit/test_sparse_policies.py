"""Selection policies: full budget is dense attention, coverage >= alpha on the sampled rows,
selections monotone in alpha, no empty rows, cached-prefix offsets, GQA, determinism; LServe's
head choice and calibration; the registry and config wiring."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_loopkv.attention import dense_attention
from sgl_loopkv.attention.calibration import load_head_scores
from sgl_loopkv.attention.policies import POLICIES, ModelShape
from sgl_loopkv.attention.policies.block import BlockTopPolicy, block_mass
from sgl_loopkv.attention.policies.config import SparsePrefillConfig
from sgl_loopkv.attention.policies.loopserve import (
    VerticalSlashPolicy,
    covered_fraction,
    line_costs,
    line_weights,
    sample_rows,
    select_lines,
)
from sgl_loopkv.attention.policies.lserve import StreamingHeadsPolicy, streaming_heads
from sgl_loopkv.attention.sampled import sampled_attention
from sgl_loopkv.attention.sparse.torch import sparse_attention
from tests.unit.test_sparse_plan import masked_reference


def qkv(seed: int, L: int, n: int, hkv: int = 2, group: int = 3, d: int = 16):
    """Random q/k/v with attention-like structure: a sink key, local bias via smooth keys."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, hkv, d, generator=g).cumsum(0) / 4  # neighbouring keys alike: local mass
    k[0] *= 4  # a sink
    q = k[L - n :].repeat_interleave(group, 1) + torch.randn(n, hkv * group, d, generator=g)
    return q, k, torch.randn(L, hkv, d, generator=g)


def causal_everywhere(mask) -> bool:
    return all(
        torch.equal(mask.dense_mask(h), torch.ones(mask.q_len, mask.kv_len).tril(mask.prefix_len).bool())
        for h in range(mask.num_heads)
    )


FULL_BUDGET = {
    "loopserve": VerticalSlashPolicy(alpha=1.0, block_size=16),
    "block": BlockTopPolicy(alpha=1.0, block_size=16),
    "lserve": StreamingHeadsPolicy(torch.ones(2, 2, dtype=torch.bool), sink=16, local=512, block_size=16),
}


@pytest.mark.parametrize("name", sorted(FULL_BUDGET))
@pytest.mark.parametrize("L,n", [(300, 300), (300, 120), (257, 100)])
def test_full_budget_is_dense_attention(name, L, n):
    q, k, v = qkv(1, L, n)
    mask = FULL_BUDGET[name].select(1, q, k, 0.25)
    assert causal_everywhere(mask) and not any(mask.full)  # every key, through the sparse kernel
    torch.testing.assert_close(
        sparse_attention(q, k, v, mask, 0.25), dense_attention(q, k, v, 0.25), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("name", ["loopserve", "block"])
@pytest.mark.parametrize("seed,L,n", [(0, 400, 400), (1, 400, 150), (2, 333, 77)])
def test_output_equals_masked_reference_and_rows_are_never_empty(name, seed, L, n):
    policy = {"loopserve": VerticalSlashPolicy(alpha=0.7, block_size=16), "block": BlockTopPolicy(0.7, 16)}[name]
    q, k, v = (x.double() for x in qkv(seed, L, n))  # float64: large logits here; fp32 rounding is not the question
    mask = policy.select(0, q, k, 0.25)
    assert mask.density() < 0.5  # actually sparse at alpha 0.7
    for h in range(mask.num_heads):
        assert mask.dense_mask(h).any(-1).all()
    torch.testing.assert_close(
        sparse_attention(q, k, v, mask, 0.25), masked_reference(q, k, v, mask, 0.25), atol=1e-10, rtol=1e-10
    )


ALPHAS = [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]


@pytest.mark.parametrize("seed,L,n", [(0, 512, 512), (3, 512, 200), (4, 301, 129)])
def test_loopserve_covers_alpha_of_the_sampled_mass_and_is_monotone(seed, L, n):
    q, k, _ = qkv(seed, L, n)
    P = L - n
    pos = P + sample_rows(n, 48, 7)
    attn = sampled_attention(q[pos - P], k, pos, 0.25)
    assert torch.allclose(attn.sum(-1), torch.ones(()).double())  # full softmax rows
    prev_sets, prev_masks = None, None
    for alpha in ALPHAS:
        sets, masks = [], []
        for h in range(attn.shape[0]):
            verticals, slashes, covered = select_lines(attn[h], pos, P, 16, alpha)
            assert covered >= alpha - 1e-9
            assert abs(covered - covered_fraction(attn[h], pos, verticals, slashes, 16)) < 1e-9
            sets.append((set(verticals.tolist()), set(slashes.tolist())))
        policy = VerticalSlashPolicy(alpha=alpha, block_size=16, seed=0)
        mask = policy.select(7, q, k, 0.25)  # the same sampled rows (seed 0, layer 7)
        for h in range(attn.shape[0]):
            seen = mask.dense_mask(h)[pos - P].double()
            assert float((attn[h] * seen).sum() / attn[h].sum()) >= alpha - 1e-9  # the executed mask covers it
            masks.append(seen.bool())
        if prev_sets is not None:
            for (v0, s0), (v1, s1) in zip(prev_sets, sets):
                assert v0 <= v1 and s0 <= s1
            for m0, m1 in zip(prev_masks, masks):
                assert not (m0 & ~m1).any()
        prev_sets, prev_masks = sets, masks


def test_loopserve_line_sums_and_costs():
    q, k, _ = qkv(5, 200, 90)
    pos = 110 + sample_rows(90, 48, 1)
    attn = sampled_attention(q[pos - 110], k, pos, 0.25)[0]
    w_v, w_s = line_weights(attn, pos, 16)
    assert torch.allclose(w_v.sum(), attn.sum()) and torch.allclose(w_s.sum(), attn.sum())
    c_v, c_s = line_costs(110, 200, 16)
    rows = torch.arange(110, 200)[:, None]
    assert torch.equal(c_v, (torch.arange(200)[None, :] <= rows).sum(0))  # causal cells per column
    slash_of = rows // 16 - torch.arange(200)[None, :] // 16
    counted = torch.stack([((slash_of == j) & (torch.arange(200)[None, :] <= rows)).sum() for j in range(len(c_s))])
    assert torch.equal(c_s, counted)


def test_loopserve_is_deterministic_and_gqa_shared():
    q, k, _ = qkv(6, 400, 400)
    a = VerticalSlashPolicy(alpha=0.8, block_size=16).select(3, q, k, 0.25)
    b = VerticalSlashPolicy(alpha=0.8, block_size=16).select(3, q, k, 0.25)
    assert torch.equal(a.block_indices, b.block_indices) and torch.equal(a.col_indices, b.col_indices)
    assert a.num_heads == k.shape[1]  # one pattern per KV head, shared by its 3 query heads


@pytest.mark.parametrize("L,n", [(512, 512), (512, 190)])
def test_block_policy_monotone_keeps_sink_and_diagonal(L, n):
    q, k, _ = qkv(8, L, n)
    est = block_mass(q, k, 0.25, 16)
    assert torch.allclose(est.sum(-1), torch.ones(()))
    prev = None
    for alpha in ALPHAS + [1.0]:
        table = BlockTopPolicy(alpha, 16).select(0, q, k, 0.25).block_table()
        qb0 = table.shape[2] - table.shape[1]
        assert table[:, :, 0].all() and table[:, torch.arange(table.shape[1]), torch.arange(table.shape[1]) + qb0].all()
        kept = (est * table).sum(-1)
        assert (kept >= min(alpha, 1.0) - 1e-6).all()
        if prev is not None:
            assert not (prev & ~table).any()
        prev = table
    assert prev.sum() == sum(qb + 1 for qb in range(qb0, table.shape[2])) * table.shape[0]  # alpha 1: every block


def test_streaming_heads_choose_the_lowest_scores():
    scores = torch.tensor([[0.5, 0.1, 0.3], [0.2, 0.9, 0.1]], dtype=torch.float64)
    assert streaming_heads(scores, 0.5).tolist() == [[False, True, False], [True, False, True]]
    assert not streaming_heads(scores, 0.0).any() and streaming_heads(scores, 1.0).all()


def test_lserve_pattern_sink_local_and_dense_heads():
    streaming = torch.tensor([[True, False]])
    policy = StreamingHeadsPolicy(streaming, sink=16, local=32, block_size=16)
    q, k, v = qkv(9, 200, 120)
    mask = policy.select(0, q, k, 0.25)
    assert mask.full == [False, True]
    qb0 = (200 - 120) // 16
    for b in range(qb0, 13):
        assert mask.blocks(0, b).tolist() == sorted({0, *range(max(0, b - 2), b + 1)})
    torch.testing.assert_close(
        sparse_attention(q, k, v, mask, 0.25), masked_reference(q, k, v, mask, 0.25), atol=1e-5, rtol=1e-5
    )


def test_smollm2_calibration_file_loads_and_missing_files_say_how_to_make_one(tmp_path):
    scores = load_head_scores("SmolLM2-135M-Instruct", 30, 3)
    assert scores.shape == (30, 3) and ((scores >= 0) & (scores <= 1)).all()
    with pytest.raises(FileNotFoundError, match="python -m sgl_loopkv.attention.calibration"):
        load_head_scores("no-such-model", 2, 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"retrieval_scores": [[0.1, 0.2]]}))
    with pytest.raises(ValueError, match="kv heads"):
        load_head_scores("x", 30, 3, str(bad))


def test_policies_are_created_by_name_from_the_config():
    shape = ModelShape("SmolLM2-135M-Instruct", 30, 9, 3)
    cfg = SparsePrefillConfig(alpha=0.9, block_size=32, streaming_sink=64, streaming_local=256, streaming_fraction=0.25)
    assert POLICIES.names() == ["block", "loopserve", "lserve"]
    tail = dict(dense_tail=cfg.dense_tail, full_density=cfg.full_density)
    assert POLICIES.create("loopserve", cfg, shape) == VerticalSlashPolicy(
        alpha=0.9, block_size=32, tail_samples=cfg.tail_samples, **tail
    )
    assert POLICIES.create("block", cfg, shape) == BlockTopPolicy(alpha=0.9, block_size=32, **tail)
    lserve = POLICIES.create("lserve", cfg, shape)
    assert int(lserve.streaming.sum()) == round(0.25 * 90) and lserve.local == 256
    with pytest.raises(ValueError, match="multiples"):
        SparsePrefillConfig(block_size=64, streaming_local=100)


@pytest.mark.parametrize("L,n", [(512, 512), (512, 190), (300, 77)])
def test_dense_tail_rows_see_every_key_and_tail_samples_are_the_last_rows(L, n):
    q, k, v = (x.double() for x in qkv(10, L, n))
    for policy in (
        VerticalSlashPolicy(alpha=0.5, block_size=16, dense_tail=20, tail_samples=8),
        BlockTopPolicy(alpha=0.5, block_size=16, dense_tail=20),
    ):
        mask = policy.select(2, q, k, 0.25)
        causal = torch.ones(n, L).tril(L - n).bool()
        for h in range(mask.num_heads):
            seen = mask.dense_mask(h)
            assert torch.equal(seen[-20:], causal[-20:])  # the tail: every causal key
            assert not torch.equal(seen, causal)  # the rest is still sparse
        torch.testing.assert_close(
            sparse_attention(q, k, v, mask, 0.25), masked_reference(q, k, v, mask, 0.25), atol=1e-10, rtol=1e-10
        )
    rows = sample_rows(n, 48, 3, tail=8)
    assert len(rows) == min(48, n) and len(set(rows.tolist())) == len(rows)
    assert set(range(n - 8, n)) <= set(rows.tolist())


def test_heads_over_the_full_density_run_dense_and_stay_monotone():
    q, k, v = (x.double() for x in qkv(11, 512, 512))
    base = VerticalSlashPolicy(alpha=0.9, block_size=16).select(0, q, k, 0.25)
    per_head = [c / (512 * 513 // 2) for c in base.visible_cells()]
    cut = max(per_head)  # the densest head goes full, the other stays sparse
    mask = VerticalSlashPolicy(alpha=0.9, block_size=16, full_density=cut).select(0, q, k, 0.25)
    assert mask.full == [d >= cut for d in per_head] and any(mask.full) and not all(mask.full)
    for h in range(2):
        assert not (base.dense_mask(h) & ~mask.dense_mask(h)).any()  # a superset of the selection
    torch.testing.assert_close(
        sparse_attention(q, k, v, mask, 0.25), masked_reference(q, k, v, mask, 0.25), atol=1e-10, rtol=1e-10
    )
    prev = None
    for alpha in ALPHAS:
        m = VerticalSlashPolicy(alpha=alpha, block_size=16, full_density=0.5).select(0, q, k, 0.25)
        seen = [m.dense_mask(h) for h in range(2)]
        if prev is not None:
            assert all(not (a & ~b).any() for a, b in zip(prev, seen))
        prev = seen
