"""The paged pool's headroom (``server/pool_size.py``): a request that stock SGLang's page-1 pool answers
in full gets its whole answer from sgl-loopkv's paged pool of the same ``--max-total-tokens``, by SGLang's
own arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from sgl_loopkv.server.pool_size import paged_pool_tokens, with_page_headroom


def clip(pool: int, page: int, prompt: int, wanted: int) -> int:
    """SGLang's arrival clip of an answer on an empty pool (``Scheduler.init_req_max_new_tokens``):
    the allocator's bound, then the request-length bound (``max_req_len = pool - 1``)."""
    allocator = SimpleNamespace(page_size=page)
    by_memory = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
        allocator, prompt, wanted, token_capacity=pool, sliding_window_size=None, chunk_size=None
    )
    return max(0, min(by_memory, pool - 1 - prompt - 1))


def admitted(pool: int, page: int, prompt: int, answer: int) -> bool:
    """``PrefillAdder``'s check on an empty pool: prompt + answer + one page of rounding < the free slots."""
    return prompt + answer + page < pool


def test_the_defect_is_the_page_rounding_of_an_unsized_pool():
    assert clip(1024, 1, 982, 16) == 16  # stock: --page-size 1
    assert clip(1024, 16, 982, 16) == 15  # the 15 tokens
    assert clip(1024, 16, 1000, 16) == 0
    assert clip(paged_pool_tokens(1024, 16), 16, 982, 16) == 16


@pytest.mark.parametrize("page", [2, 16, 64])
@pytest.mark.parametrize("tokens", [1000, 1024, 2048])
def test_every_answer_stock_gives_in_full_fits_the_sized_pool(tokens, page):
    pool = paged_pool_tokens(tokens, page)
    assert pool % page == 0 and tokens <= pool < tokens + 3 * page
    for prompt in range(tokens - 300, tokens):
        for wanted in (1, 16, 100):
            if clip(tokens, 1, prompt, wanted) < wanted:
                continue  # stock clips this one too
            assert clip(pool, page, prompt, wanted) == wanted, (prompt, wanted)
            assert admitted(pool, page, prompt, wanted), (prompt, wanted)
            assert -(-(prompt + wanted - 1) // page) * page <= pool  # and its KV fits the slots


def test_headroom_only_where_the_pool_is_paged():
    assert paged_pool_tokens(1024, 1) == 1024
    assert with_page_headroom(["--max-total-tokens", "1024", "--page-size", "16"]) == [
        "--max-total-tokens",
        "1056",
        "--page-size",
        "16",
    ]
    assert with_page_headroom(["--page-size=16", "--max-total-tokens=1000"]) == [
        "--page-size=16",
        "--max-total-tokens=1040",
    ]
    for argv in (
        ["--max-total-tokens", "1024"],  # SGLang's own page size (1)
        ["--page-size", "16"],  # the pool sized from memory
        ["--max-total-tokens", "lots", "--page-size", "16"],  # SGLang rejects it
        ["--max-total-tokens", "1024", "--page-size", "1"],
    ):
        assert with_page_headroom(argv) == argv


def test_the_launcher_sizes_loopkv_pools_and_leaves_stock_as_shipped():
    from tests.helpers import run_fresh

    out = run_fresh(
        """
        import json
        from sgl_loopkv.server.launch import build_sglang_argv
        argv = lambda *a: build_sglang_argv(["--model-path", "/m", "--loopkv-device", "cpu", *a])[1]
        print(json.dumps([argv(), argv("--max-total-tokens", "1024"), argv("--loopkv-stock", "--max-total-tokens", "1024")]))
        """
    )
    default, sized, stock = (argv[argv.index("--max-total-tokens") + 1] for argv in out)
    assert (default, sized, stock) == (str(paged_pool_tokens(32768, 16)), "1056", "1024")
