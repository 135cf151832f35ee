"""Sparse plans and the torch sparse executor against a masked dense reference, on random tensors:
random plans (property test), full-budget plans (= dense attention), cached-prefix offsets, GQA,
full heads, batches mixing sparse and dense sequences in a shuffled KV pool."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_loopkv.attention import EXECUTORS, build_dense_plan, dense_attention
from sgl_loopkv.attention.sparse import SPARSE_EXECUTORS
from sgl_loopkv.attention.sparse import torch as sx
from sgl_loopkv.attention.sparse.torch import sparse_attention
from sgl_loopkv.attention.sparse_plan import SeqMask, SparsePlan


def masked_reference(q, k, v, mask: SeqMask, scale):
    """softmax(q k^T * scale, -inf outside mask.dense_mask(head)) v in float64, GQA spelled out."""
    n, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.empty(n, hq, v.shape[-1], dtype=torch.float64)
    for h in range(hkv):
        allowed = mask.dense_mask(h)
        for j in range(h * g, (h + 1) * g):
            s = (q[:, j].double() @ k[:, h].double().T) * scale
            out[:, j] = s.masked_fill(~allowed, -math.inf).softmax(-1) @ v[:, h].double()
    return out.to(q.dtype)


def random_mask(g: torch.Generator, L: int, n: int, heads: int, block: int, p: float) -> SeqMask:
    nb, qb0 = -(-L // block), (L - n) // block
    table = torch.rand(heads, nb - qb0, nb, generator=g) < p
    cols = [torch.randperm(L, generator=g)[: int(torch.randint(0, 12, (1,), generator=g))] for _ in range(heads)]
    full = [bool(torch.rand(1, generator=g) < 0.2) for _ in range(heads)]
    return SeqMask.from_block_table(table, L, n, block, cols, full)


@pytest.mark.parametrize("seed", range(24))
def test_random_plans_equal_masked_reference(seed):
    g = torch.Generator().manual_seed(seed)
    block = [4, 8, 16][seed % 3]
    hkv, group = [(1, 1), (2, 3), (3, 2)][seed % 3]
    L = int(torch.randint(1, 160, (1,), generator=g))
    n = int(torch.randint(1, L + 1, (1,), generator=g))  # n < L: queries at an offset (cached prefix)
    mask = random_mask(g, L, n, hkv, block, p=float(torch.rand(1, generator=g)))
    q = torch.randn(n, hkv * group, 8, generator=g)
    k, v = torch.randn(L, hkv, 8, generator=g), torch.randn(L, hkv, 8, generator=g)
    out = sparse_attention(q, k, v, mask, 0.4)
    torch.testing.assert_close(out, masked_reference(q, k, v, mask, 0.4), atol=1e-5, rtol=1e-5)
    assert mask.visible_cells() == [int(mask.dense_mask(h).sum()) for h in range(hkv)]


@pytest.mark.parametrize("L,n", [(200, 200), (200, 37), (193, 64), (64, 1), (1, 1)])
def test_all_blocks_plan_equals_dense_attention(L, n):
    g = torch.Generator().manual_seed(L + n)
    q = torch.randn(n, 6, 16, generator=g)
    k, v = torch.randn(L, 2, 16, generator=g), torch.randn(L, 2, 16, generator=g)
    mask = SeqMask.all_blocks(2, L, n, 16)
    assert mask.density() == 1.0
    torch.testing.assert_close(
        sparse_attention(q, k, v, mask, 0.25), dense_attention(q, k, v, 0.25), atol=1e-5, rtol=1e-5
    )


def test_no_query_row_is_ever_empty():
    g = torch.Generator().manual_seed(0)
    for L, n in [(100, 100), (100, 30), (33, 33)]:
        empty = SeqMask.from_block_table(
            torch.zeros(2, -(-L // 8) - (L - n) // 8, -(-L // 8), dtype=torch.bool), L, n, 8
        )
        for h in range(2):
            assert empty.dense_mask(h).any(-1).all()
        q, k, v = (
            torch.randn(n, 2, 8, generator=g),
            torch.randn(L, 2, 8, generator=g),
            torch.randn(L, 2, 8, generator=g),
        )
        assert torch.isfinite(sparse_attention(q, k, v, empty, 0.3)).all()


def test_block_table_round_trip_drops_non_causal_blocks():
    table = torch.ones(1, 3, 5, dtype=torch.bool)  # L=40, n=20, B=8: query blocks 2..4
    mask = SeqMask.from_block_table(table, 40, 20, 8, full=[False])
    assert mask.first_q_block == 2 and mask.num_q_blocks == 3
    assert [mask.blocks(0, b).tolist() for b in (2, 3, 4)] == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert torch.equal(SeqMask.from_block_table(mask.block_table(), 40, 20, 8).block_table(), mask.block_table())


def test_chunked_execution_equals_single_chunk(monkeypatch):
    g = torch.Generator().manual_seed(7)
    mask = random_mask(g, 300, 250, 2, 16, p=0.3)
    q = torch.randn(250, 4, 8, generator=g)
    k, v = torch.randn(300, 2, 8, generator=g), torch.randn(300, 2, 8, generator=g)
    whole = sparse_attention(q, k, v, mask, 0.3)
    monkeypatch.setattr(sx, "_CHUNK_BYTES", 1)  # one item per call
    torch.testing.assert_close(sparse_attention(q, k, v, mask, 0.3), whole, atol=1e-6, rtol=1e-6)
    monkeypatch.setattr(sx, "_PAD", 1)  # no padding: every key-list length its own call
    torch.testing.assert_close(sparse_attention(q, k, v, mask, 0.3), whole, atol=1e-6, rtol=1e-6)


def test_executor_runs_a_batch_of_sparse_and_dense_sequences():
    g = torch.Generator().manual_seed(3)
    pool, hkv, hq, d = 600, 2, 4, 8
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    seq_lens, q_lens, rows = [120, 50, 90], [120, 1, 40], [2, 0, 5]
    req_to_token = torch.zeros(8, 256, dtype=torch.int32)
    perm, used = torch.randperm(pool, generator=g), 0
    for r, n in zip(rows, seq_lens):
        req_to_token[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    base = build_dense_plan(req_to_token, rows, seq_lens, q_lens)
    masks = [random_mask(g, 120, 120, hkv, 16, 0.4), None, random_mask(g, 90, 40, hkv, 16, 0.4)]
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    out = SPARSE_EXECUTORS.create("torch").run(SparsePlan(base, masks), q, k_cache, v_cache, 0.3, torch.empty_like(q))
    dense_out = EXECUTORS.create("torch").run(base, q, k_cache, v_cache, 0.3, torch.empty_like(q))
    for i, (r, n) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[r, :n].long()
        sl = slice(base.qo_indptr[i], base.qo_indptr[i + 1])
        if masks[i] is None:  # left dense: the dense executor's numbers, bit for bit
            assert torch.equal(out[sl], dense_out[sl])
        else:
            ref = masked_reference(q[sl], k_cache[slots], v_cache[slots], masks[i], 0.3)
            torch.testing.assert_close(out[sl], ref, atol=1e-5, rtol=1e-5)


def test_sparse_plan_rejects_a_mask_of_another_shape():
    base = build_dense_plan(torch.arange(40).view(2, 20), [0], [12], [12])
    with pytest.raises(ValueError, match="mask for"):
        SparsePlan(base, [SeqMask.all_blocks(1, 10, 10, 4)])


def test_density_counts_columns_once():
    mask = SeqMask.from_block_table(
        torch.zeros(1, 4, 4, dtype=torch.bool), 32, 32, 8, cols=[torch.tensor([0, 1, 9, 31])]
    )
    dense = mask.dense_mask(0)
    assert mask.visible_cells() == [int(dense.sum())]
    assert 0 < mask.density() < 1
