"""Sparse decode: per-(layer, KV head) page plans for one query row per sequence.

A policy decides, for one sequence in one layer at one decode step, which *physical pages* each KV
head reads (:class:`DecodePolicy`). The selector (:mod:`.selector`) keeps the per-sequence state,
turns pages into pool slots and runs the executor. Pages are chosen for the whole GQA group of a KV
head (its query heads share one selection: FreeKV's group consistency), which is what lets one
(sequence, KV head) read each key once for all its query heads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from sgl_loopkv.selection.pages import chunk_minmax, group_max, score_bound, top_pages


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """The policy knobs, in tokens (``--loopkv-decode-*``)."""

    budget: int = 1024
    page_size: int = 64
    logical_page: int = 16
    sink: int = 64
    local: int = 128
    reuse: int = 4
    tau: float = 0.9
    n_d: int = 16
    dense_steps: int = 16
    min_context: int = 2048

    @classmethod
    def from_config(cls, cfg) -> DecodeParams:
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__})


@dataclass(slots=True)
class LayerState:
    """One sequence in one layer. ``summaries`` cover positions < ``summarized`` (logical pages; the
    last one may be partial); ``pages`` were chosen when the sequence had ``sel_len`` tokens
    (positions from ``sel_len`` on are read as the local window until the next selection)."""

    summaries: torch.Tensor | None = None  # [Hkv, capacity >= n_logical, 2, D] float32 (head-major: scored in place)
    summarized: int = 0
    pages: torch.Tensor | None = None  # [Hkv, k] ascending physical page ids
    sel_len: int = 0
    selected_at: int = -1  # decode step of the selection
    next_pages: tuple[torch.Tensor, int] | None = None  # freekv: (pages, length) chosen with the previous query
    last_q: torch.Tensor | None = None  # freekv: the previous step's query [Hkv, g, D]
    recent_q: list[torch.Tensor] = field(default_factory=list)  # loopserve: queries since the selection
    index: torch.Tensor | None = None  # the selection as executor indices [Hkv, m] (cached until re-selection)


class SeqKeys:
    """What a policy may read of one sequence in one layer: its length and its keys (pool rows
    [L, Hkv, D], read on demand), and the page summaries (brought up to date on demand, reading only
    the keys appended since the last call: incremental, equal to recomputing them). ``fold(buf,
    start, end)``, when given, folds the keys of positions [start, end) into the head-major buffer in
    place (the native ``update_summaries``: one call instead of ~8 torch ops per sequence and layer)."""

    def __init__(self, keys_fn, length: int, state: LayerState, logical_page: int, fold=None):
        self._keys_fn, self.length, self.state, self.logical_page = keys_fn, length, state, logical_page
        self._fold = fold

    def keys(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self._keys_fn(start, self.length if end is None else end)

    def summaries(self) -> torch.Tensor:
        """[n_logical, Hkv, 2, D]: a view of the state's head-major buffer (what the score reads)."""
        st, lp = self.state, self.logical_page
        n = -(-self.length // lp)
        if st.summaries is None or st.summarized < self.length:
            first = st.summarized // lp  # a partial last page is recomputed from its first token (or folded)
            if st.summaries is None or st.summaries.shape[1] < n:  # grow by half: appends stay amortised O(1)
                empty = self.keys(0, 0)  # [0, Hkv, D]: the geometry
                grown = torch.empty(empty.shape[1], n + n // 2 + 8, 2, empty.shape[2], device=empty.device)
                if st.summaries is not None:
                    grown[:, :first] = st.summaries[:, :first]
                    if self._fold is not None and first * lp < st.summarized:  # the partial page being folded
                        grown[:, first] = st.summaries[:, first]
                st.summaries = grown
            if self._fold is not None:
                self._fold(st.summaries, st.summarized, self.length)
            else:
                st.summaries[:, first:n] = chunk_minmax(self.keys(first * lp, self.length), lp).transpose(0, 1)
            st.summarized = self.length
        return st.summaries[:, :n].transpose(0, 1)


class DecodePolicy(ABC):
    """Chooses the physical pages every KV head of one sequence reads at one decode step.

    ``choose`` gets the step (0 at the sequence's first sparse step), the layer's query of the new
    token grouped by KV head, q [Hkv, g, D] (post-RoPE), and the sequence's keys. It returns page
    ids [Hkv, k] (ascending, the same count per head, sink and local pages included, the page
    holding its last position included) with the sequence length they were chosen for (positions
    from there on are read as the local window), or None to keep ``state.pages``.

    Contract (tests/unit/test_sparse_decode.py): with a budget covering the context every page is
    chosen; the result never exceeds the budget (whole pages); it is a deterministic function of
    its inputs and the state.
    """

    def __init__(self, params: DecodeParams):
        self.p = params
        self.native = None  # the CPU kernels' module (set by the selector): one-call page selection
        self.corrections = 0  # freekv: speculative selections replaced
        self.decisions = 0

    @abstractmethod
    def choose(
        self, state: LayerState, step: int, q: torch.Tensor, seq: SeqKeys, scale: float
    ) -> tuple[torch.Tensor, int] | None: ...

    # --- shared pieces ---------------------------------------------------------------------------
    def n_pages(self, length: int) -> int:
        return -(-length // self.p.page_size)

    def local_pages(self, length: int) -> int:
        """Physical pages covering the last ``local`` positions (at least the last page)."""
        ps = self.p.page_size
        return (length - 1) // ps - max(length - self.p.local, 0) // ps + 1

    def top(self, page_scores: torch.Tensor, length: int) -> torch.Tensor:
        """page_scores [Hkv, n_pages] -> the budget's best pages per head, sink and local forced."""
        ps = self.p.page_size
        return top_pages(page_scores, self.p.budget // ps, -(-self.p.sink // ps), self.local_pages(length))

    def by_bound(self, q: torch.Tensor, seq: SeqKeys) -> torch.Tensor:
        """LServe's hierarchical selection: logical-page bounds, maxed over the query heads of a
        group and over the logical pages of a physical page, top pages (one native call on CPU:
        the same pages, ties to the lower id; tests/unit/test_sparse_decode.py)."""
        summaries, per, ps = seq.summaries(), self.p.page_size // self.p.logical_page, self.p.page_size
        buf = seq.state.summaries
        if self.native is not None and buf.device.type == "cpu" and -(-seq.length // ps) > self.p.budget // ps:
            forced = -(-self.p.sink // ps), self.local_pages(seq.length)  # sink and local pages
            return self.native.select_pages(
                q.float().contiguous(), buf, summaries.shape[0], per, self.p.budget // ps, *forced
            )
        bound = score_bound(q, summaries).amax(dim=1)  # [Hkv, n_logical]
        return self.top(group_max(bound, per), seq.length)
