"""Sparse decode: the page summaries and their score bound, the policies' contract and the selector
against dense attention over a fragmented pool (native kernel and torch fallback)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_loopkv.attention.decode import DECODE_POLICIES, DecodeParams, LayerState, SeqKeys
from sgl_loopkv.attention.decode.selector import SparseDecoder
from sgl_loopkv.cache.layout import key_summaries
from sgl_loopkv.kernels import paged_decode
from sgl_loopkv.selection.pages import chunk_minmax, group_max, pages_to_positions, score_bound, top_pages
from tests.unit.test_paged_decode import reference

POLICIES = ["freekv", "loopserve", "lserve"]
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def pool(seed, lens, hkv=3, d=32, size=16384, page=16, dtype=torch.float32):
    """Pool buffers and per-sequence slots over shuffled 16-token pages."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(size, hkv, d, generator=g).to(dtype)
    v = torch.randn(size, hkv, d, generator=g).to(dtype)
    pages = torch.randperm(size // page, generator=g).tolist()
    slots = []
    for n in lens:
        own, pages = pages[: -(-n // page)], pages[-(-n // page) :]
        slots.append(torch.cat([torch.arange(p * page, (p + 1) * page) for p in own])[:n])
    return k, v, slots


def decoder(policy, native, **params):
    """native: the CPU kernel; else the torch reference executor (the GPU interface's)."""
    lib = paged_decode.load() if native else None
    if native and lib is None:
        pytest.skip("the native paged-decode kernel cannot be built here")
    pol = DECODE_POLICIES.create(policy, DecodeParams(**params))
    return SparseDecoder(pol, num_layers=2, native=lib, executor="native" if native else "reference")


def step(dec, ids, slots, q, k, v, layer=0):
    out = torch.empty_like(q)
    assert dec.begin(ids, slots)
    return dec.run(layer, q, k, v, 0.2, out)


# --- summaries and the bound --------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_score_bound_is_at_least_the_true_max_over_every_page(n, g, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 2, 8, generator=gen) * torch.rand(1, generator=gen) * 10
    q = torch.randn(2, g, 8, generator=gen)
    bound = score_bound(q, chunk_minmax(k, 16))  # [H, g, pages]
    true = torch.einsum("hgd,lhd->hgl", q, k)
    for j in range(bound.shape[-1]):
        assert (bound[..., j] >= true[..., j * 16 : (j + 1) * 16].amax(-1) - 1e-4).all()


def test_stored_chunk_summaries_are_the_selection_modules():
    k = torch.randn(2, 64, 3, 8)
    assert torch.equal(key_summaries(k, 16), chunk_minmax(k, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", NATIVE)
def test_incremental_summaries_equal_recomputed_ones(native, dtype):
    k_pool, _, (slots,) = pool(3, [300], d=8, size=1024, dtype=dtype)  # fragmented slots, as in the server
    k = k_pool[slots]
    lib = paged_decode.load() if native else None
    if native and lib is None:
        pytest.skip("the native paged-decode kernel cannot be built here")
    fold = (lambda buf, a, e: lib.update_summaries(buf, k_pool, slots, a, e, 16)) if native else None
    state = LayerState()
    for length in [1, 15, 16, 17, 40, 41, 64, 200, 300]:  # appends inside, at and across page edges
        seq = SeqKeys(lambda a, e: k[a:e], length, state, 16, fold)
        assert torch.equal(seq.summaries(), chunk_minmax(k[:length], 16))


def test_native_summary_update_refuses_positions_past_its_buffer():
    lib = paged_decode.load()
    if lib is None:
        pytest.skip("the native paged-decode kernel cannot be built here")
    k_pool, _, (slots,) = pool(4, [64], d=8, size=256)
    with pytest.raises(RuntimeError, match="capacity"):
        lib.update_summaries(torch.zeros(3, 2, 2, 8), k_pool, slots, 0, 64, 16)  # 4 pages into 2


def test_top_pages_keeps_sink_and_local_and_the_budget():
    scores = torch.randn(3, 40)
    pages = top_pages(scores, budget=10, sink=2, local=3)
    assert pages.shape == (3, 10)
    for h in range(3):
        chosen = set(pages[h].tolist())
        assert {0, 1, 37, 38, 39} <= chosen
        free = sorted(set(range(2, 37)), key=lambda j: -scores[h, j].item())[:5]
        assert chosen == {0, 1, 37, 38, 39, *free}
    assert torch.equal(top_pages(scores, budget=40, sink=1, local=1), torch.arange(40).expand(3, 40))


# --- the selector: exactness at full budget, the contract below it ---------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: the GGUF path's pool, float32 q
@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("policy", POLICIES)
def test_full_budget_equals_dense_attention(policy, native, dtype):
    lens = [2100, 3000, 700]  # the last one below min_context: dense in the same call
    k, v, slots = pool(0, lens, dtype=dtype)
    dec = decoder(policy, native, budget=4096, min_context=1024, tau=0.5)
    for s in range(3):
        q = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(s))
        out = step(dec, [7, 8, 9], slots, q, k, v)
        torch.testing.assert_close(out.double(), reference(q, k, v, slots, 0.2), atol=2e-5, rtol=1e-4)
    assert dec.stats.selected_fraction == 1.0


def _sparse_reference(q, k, v, index_of_seq, hkv, scale):
    """Per query head: attention over exactly the keys its KV head's plan lists (float64)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // hkv
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            rows = index_of_seq[i][h // g]  # flat rows slot * hkv + kv head
            kk = k.reshape(-1, k.shape[-1])[rows].double()
            vv = v.reshape(-1, v.shape[-1])[rows].double()
            out[i, h] = ((q[i, h].double() @ kk.T) * scale).softmax(-1) @ vv
    return out


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("policy", POLICIES)
def test_below_budget_each_group_reads_one_selection_within_the_budget(policy, native):
    lens = [4000, 2500]
    k, v, slots = pool(1, lens)
    dec = decoder(policy, native, budget=512, min_context=1024, sink=64, local=128, reuse=3, n_d=4, dense_steps=0)
    dec.keep_index = True
    for s in range(6):
        q = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(10 + s))
        cur = [sl[: len(sl) - 6 + s] for sl in slots]  # one token more each step
        out = step(dec, ["a", "b"], cur, q, k, v)
        index = [dec.states[sid].layers[0].index for sid in ["a", "b"]]
        for i, sid in enumerate(["a", "b"]):
            st_ = dec.states[sid].layers[0]
            assert st_.pages.shape == (3, 512 // 64), "one selection per KV head, whole pages in budget"
            assert (st_.pages[:, 0] == 0).all() and (st_.pages[:, -1] == (st_.sel_len - 1) // 64).all()
            assert (index[i] % 3 == torch.arange(3)[:, None]).all(), "each KV head reads its own rows"
            assert index[i].shape[1] <= 512 and torch.isin(index[i] // 3, slots[i]).all()
        read = [rows.view(3, -1) for rows in dec.last_index]  # the selection plus tokens since it (local)
        assert all(r.shape[1] <= 512 + 6 for r in read)
        torch.testing.assert_close(out.double(), _sparse_reference(q, k, v, read, 3, 0.2), atol=2e-5, rtol=1e-4)
    assert 0 < dec.stats.selected_fraction < 0.25


def test_freekv_with_tau_above_one_is_non_speculative_retrieval():
    """tau > 1 corrects every step: the pages are those chosen with the current query each step,
    which is lserve re-selecting every step (reuse 1)."""
    k, v, slots = pool(2, [3000])
    spec = decoder("freekv", True, budget=512, min_context=1024, tau=1.01)
    plain = decoder("lserve", True, budget=512, min_context=1024, reuse=1)
    for s in range(5):
        q = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(20 + s))
        cur = [slots[0][: 2990 + s]]  # one token more each step
        a, b = step(spec, [1], cur, q, k, v), step(plain, [1], cur, q, k, v)
        assert torch.equal(spec.states[1].layers[0].pages, plain.states[1].layers[0].pages)
        assert torch.equal(a, b)
    assert spec.policy.corrections == 4 * 3  # every KV head of every step after the first


def test_freekv_speculates_with_the_previous_query_until_they_drift():
    k, v, slots = pool(3, [3000])
    dec = decoder("freekv", True, budget=512, min_context=1024, tau=0.9)
    q0 = torch.randn(1, 9, 32)
    at = lambda n: [slots[0][:n]]  # noqa: E731
    step(dec, [1], at(2900), q0, k, v)
    first = dec.states[1].layers[0].pages.clone()
    step(dec, [1], at(2901), q0 + 0.01 * torch.randn_like(q0), k, v)  # similar: the speculation stands
    assert torch.equal(dec.states[1].layers[0].pages, first) and dec.policy.corrections == 0
    step(dec, [1], at(2902), torch.randn(1, 9, 32), k, v)  # unrelated query: every head corrected
    assert dec.policy.corrections == 3
    drift_one = dec.states[1].layers[0].last_q.clone().view(1, 9, 32)
    drift_one[0, 6:] = torch.randn(3, 32)  # only KV head 2's group drifts: only it re-selects
    before = dec.states[1].layers[0].pages.clone()
    step(dec, [1], at(2903), drift_one, k, v)
    after = dec.states[1].layers[0].pages
    assert dec.policy.corrections == 4 and torch.equal(after[:2], before[:2])


def test_lserve_reuses_a_selection_and_reads_new_tokens_as_local():
    k, v, slots = pool(4, [3000])
    dec = decoder("lserve", True, budget=512, min_context=1024, reuse=4)
    full = slots[0]
    for s in range(6):
        cur = [full[: 2000 + s]]
        step(dec, [1], cur, torch.randn(1, 9, 32), k, v)
    assert dec.policy.decisions == 2  # steps 0 and 4
    st_ = dec.states[1].layers[0]
    assert st_.sel_len == 2004 and st_.selected_at == 4


def test_loopserve_reselects_from_recent_attention_mass():
    """Keys that the recent queries attend to strongly are chosen, wherever they are."""
    k, v, slots = pool(5, [3000])
    target = slots[0][1500:1510]
    k[target] = 4.0  # a hot spot in the middle
    dec = decoder("loopserve", True, budget=512, min_context=1024, n_d=2, dense_steps=0)
    for _ in range(3):
        step(dec, [1], slots, torch.ones(1, 9, 32), k, v)
    pages = dec.states[1].layers[0].pages
    assert (pages == 1500 // 64).any(dim=1).all()


def test_loopserve_reads_every_key_for_its_first_steps_then_selects_from_their_queries():
    """LoopServe's Algorithm 6 selects first at n_o = dense_steps, from the queries of those steps."""
    k, v, slots = pool(5, [3000])
    target = slots[0][1500:1510]
    k[target] = 4.0
    dec = decoder("loopserve", True, budget=512, min_context=1024, n_d=4, dense_steps=3)
    dec.keep_index = True
    full = slots[0]
    for s in range(8):
        cur = [full[: 2000 + s]]
        q = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(s))
        out = step(dec, [1], cur, q, k, v)
        read = dec.last_index[0].view(3, -1)
        if s < 3:  # dense: every key, and the output is dense attention
            assert read.shape[1] == len(cur[0])
            torch.testing.assert_close(out.double(), reference(q, k, v, cur, 0.2), atol=2e-5, rtol=1e-4)
        else:
            assert read.shape[1] <= 512 + 4
    assert dec.policy.decisions == 2  # steps 3 and 7
    assert dec.states[1].layers[0].selected_at == 7


def test_a_sequence_that_skips_steps_starts_afresh():
    """A request preempted and re-admitted may hold other slots: its old selection must not be read."""
    k, v, slots = pool(7, [3000])
    dec = decoder("lserve", True, budget=512, min_context=1024, reuse=8)
    step(dec, [1], [slots[0][:2000]], torch.randn(1, 9, 32), k, v)
    step(dec, [1], [slots[0][:2001]], torch.randn(1, 9, 32), k, v)
    assert dec.states[1].step == 1 and dec.policy.decisions == 1  # reused
    moved = slots[0][:2100].flip(0)  # same id, other slots, not the next length
    step(dec, [1], [moved], torch.randn(1, 9, 32), k, v)
    assert dec.states[1].step == 0 and dec.policy.decisions == 2
    assert torch.isin(dec.states[1].layers[0].index // 3, moved).all()


def test_sequences_below_min_context_take_the_dense_path():
    k, v, slots = pool(6, [500, 900])
    dec = decoder("lserve", True, min_context=1024)
    assert not dec.begin([1, 2], slots)
    assert dec.states == {}


@pytest.mark.parametrize(
    "n,per,budget,sink,local", [(37, 4, 5, 1, 2), (496, 4, 16, 1, 3), (64, 1, 10, 2, 2), (9, 4, 2, 1, 1)]
)
def test_native_page_selection_equals_the_torch_path(n, per, budget, sink, local):
    """The one-call CPU selection picks the same pages as score_bound + group_max + top_pages,
    from the head-major summaries the decode state keeps (a partial last physical page included)."""
    lib = paged_decode.load()
    if lib is None:
        pytest.skip("the native paged-decode kernel cannot be built here")
    gen = torch.Generator().manual_seed(n * 31 + per)
    for _ in range(5):
        k = torch.randn(n * 16 - 5, 3, 64, generator=gen)
        q = torch.randn(3, 3, 64, generator=gen)
        summ = chunk_minmax(k, 16)  # [n, H, 2, D]
        buf = torch.empty(3, n + 7, 2, 64)
        buf[:, :n] = summ.transpose(0, 1)
        want = top_pages(group_max(score_bound(q, summ).amax(dim=1), per), budget, sink, local)
        assert torch.equal(lib.select_pages(q, buf, n, per, budget, sink, local), want)


@pytest.mark.parametrize("length", [64 * 9, 64 * 9 - 1, 64 * 8 + 1])
def test_native_plan_rows_equal_the_torch_path(length):
    """Pages -> plan rows (slot * Hkv + head) in one native call: the torch path's rows, the
    sequence's partial last page clipped, over a scattered slot list."""
    lib = paged_decode.load()
    if lib is None:
        pytest.skip("the native paged-decode kernel cannot be built here")
    n = -(-length // 64)
    slots = torch.randperm(5000)[:length]
    pages = torch.stack([torch.cat([torch.randperm(n - 1)[:3].sort().values, torch.tensor([n - 1])]) for _ in range(3)])
    heads = torch.arange(3)[:, None]
    want = slots[pages_to_positions(pages, 64, length)] * 3 + heads
    assert torch.equal(lib.page_rows(pages, slots, 64, length), want)
