"""The KV pool that ``--max-total-tokens`` buys under a paged cache: what stock SGLang's pool gives a request.

sgl-loopkv's cache needs pages of ``P`` tokens (``--page-size``, = the tiers' chunk), stock SGLang's
CPU configuration pages by one token. SGLang's scheduler charges a request of a paged pool more of
the pool than the same request of a page-1 pool, on top of the tokens it stores:

- the answer is clipped on arrival (``Scheduler.init_req_max_new_tokens`` through the allocator's
  ``max_new_tokens_for_memory``) to ``pool - ceil_P(prompt) - P - 1`` tokens, where a page-1 pool
  allows ``pool - prompt - 2``: up to ``2 (P - 1)`` tokens fewer;
- admission (``PrefillAdder.add_one_req``) reserves ``P`` tokens of rounding per request, not 1;
- the pool itself is cut down to whole pages.

With ``--max-total-tokens 1024`` a 982-token prompt asking for 16 tokens got 15 (``finish_reason``
"length") where stock answers 16, a 1000-token one got none, fresh or resumed alike. The tokens it
stores fit the same pool (``ceil_P(prompt + answer - 1) <= pool`` whenever the prompt and answer fit
a page-1 pool), so the pool gets those ``2 (P - 1)`` tokens, in whole pages, beside the user's
budget: every request stock SGLang answers in full with ``--max-total-tokens N``, sgl-loopkv answers
in full too (and one within two pages of the pool's size, which stock clips, a little longer).
"""

from __future__ import annotations

POOL_FLAG, PAGE_FLAG = "--max-total-tokens", "--page-size"


def paged_pool_tokens(tokens: int, page_size: int) -> int:
    """Slots of a pool of pages of ``page_size`` tokens that holds every request a page-1 pool of
    ``tokens`` slots holds, by SGLang's scheduler's accounting: ``tokens`` plus ``2 (page_size - 1)``,
    rounded up to whole pages."""
    if page_size <= 1:
        return tokens
    return -(-(tokens + 2 * (page_size - 1)) // page_size) * page_size


def _value(argv: list[str], flag: str) -> tuple[int, int, bool] | None:
    """(index in ``argv``, value, whether spelt ``flag=N``) of the last ``flag N`` / ``flag=N`` given."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = (i + 1, argv[i + 1], False)
        elif a.startswith(flag + "="):
            found = (i, a.split("=", 1)[1], True)
    if found is None:
        return None
    try:
        return found[0], int(found[1]), found[2]
    except ValueError:
        return None  # SGLang's parser rejects it with its own message


def with_page_headroom(argv: list[str]) -> list[str]:
    """``argv`` (SGLang's, defaults filled in) with ``--max-total-tokens`` sized by
    :func:`paged_pool_tokens` for its ``--page-size``. Unchanged without either flag (SGLang sizes the
    pool from memory then, or pages by one token)."""
    pool, page = _value(argv, POOL_FLAG), _value(argv, PAGE_FLAG)
    if pool is None or page is None or pool[1] <= 0:
        return list(argv)
    out, (i, tokens, joined) = list(argv), pool
    tokens = paged_pool_tokens(tokens, page[1])
    out[i] = f"{POOL_FLAG}={tokens}" if joined else str(tokens)
    return out
