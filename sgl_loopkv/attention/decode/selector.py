"""Runs a decode policy for a batch: per-sequence state, pages -> pool slots, one executor call per layer.

Engine-agnostic: it sees sequence ids, each sequence's pool slots in position order and one layer's
pool buffers, so the backend (SGLang) and the fidelity harness (``benchmarks/decode_sparse.py``)
drive the same code. Sequences shorter than ``min_context`` read every key, in the same call.

The plan of one layer is per (sequence, KV head): ``head_indptr`` [B * Hkv + 1] and the slots each
KV head reads. The CPU executor is the native paged-decode kernel run over the pool viewed as
[slots * Hkv, 1, D] (row ``slot * Hkv + h`` is KV head ``h`` of ``slot``): every (sequence, KV head)
becomes a one-KV-head sequence whose ``g`` query heads are computed together, each selected key
read once, in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from sgl_loopkv.attention.decode.base import DecodePolicy, LayerState, SeqKeys
from sgl_loopkv.attention.executor import DECODE_MIN_SPLIT
from sgl_loopkv.selection.pages import pages_to_positions


@dataclass(slots=True)
class SeqState:
    layers: list[LayerState]
    step: int = -1  # sparse decode steps taken
    length: int = 0  # tokens at the latest step: a step that is not the next one starts afresh


@dataclass(slots=True)
class DecodeStats:
    """Totals since start: fraction read = selected / context key-reads of the sparse sequences."""

    steps: int = 0  # decode batches that ran at least one sparse sequence
    selected_tokens: int = 0  # per (sequence, layer, KV head), summed
    context_tokens: int = 0
    recalled_bytes: int = 0  # pages copied from a slower tier (the host-resident recall is not built yet)

    @property
    def selected_fraction(self) -> float:
        return self.selected_tokens / self.context_tokens if self.context_tokens else 1.0


@dataclass(slots=True)
class _Batch:
    ids: list
    slots: list[torch.Tensor]
    sparse: list[bool]
    dense_index: list[torch.Tensor | None] = field(default_factory=list)  # per sequence, for dense ones
    tails: dict = field(default_factory=dict)  # (sequence, from) -> the local window's rows: the same in every layer
    heads: torch.Tensor | None = None  # [Hkv, 1]


EXECUTOR_NAMES = ("auto", "native", "reference", "triton", "flashinfer")


class SparseDecoder:
    """``executor``: 'native' (the CPU kernel, ``native`` its loaded module), 'reference' (torch),
    'triton' or 'flashinfer' (GPU); 'auto' = native on CPU when it loaded, triton on CUDA, else
    reference. Every one is the same contract (tests/unit/test_sparse_decode*.py)."""

    def __init__(self, policy: DecodePolicy, num_layers: int, native=None, executor: str = "auto"):
        self.policy, self.num_layers, self.native = policy, num_layers, native
        if native is not None and hasattr(native, "select_pages"):
            policy.native = native
        self._page_rows = getattr(native, "page_rows", None)
        self._update_summaries = getattr(native, "update_summaries", None)
        if executor not in EXECUTOR_NAMES:
            raise ValueError(f"sparse decode executor must be one of {EXECUTOR_NAMES}, not {executor!r}")
        if executor == "native" and native is None:
            raise ValueError("the native sparse decode executor needs the native paged-decode kernel")
        self.executor = executor
        self._interface = None
        self.p = policy.p
        self.states: dict = {}
        self.stats = DecodeStats()
        self.batch: _Batch | None = None
        self.keep_index = False  # True: ``last_index`` keeps each sequence's flat rows of the latest layer (harness)
        self.last_index: list[torch.Tensor] = []

    def begin(self, ids: list, slots: list[torch.Tensor]) -> bool:
        """Start a decode step for sequences ``ids`` with pool ``slots`` (each [L_i], position order,
        the new token's last). False when every sequence decodes densely (the caller's dense path)."""
        sparse = [len(s) >= self.p.min_context for s in slots]
        for gone in self.states.keys() - set(ids):  # finished or preempted: a re-selection is cheap
            del self.states[gone]
        if not any(sparse):
            self.batch = None
            return False
        for sid, sp, sl in zip(ids, sparse, slots):
            if sp:
                st = self.states.get(sid)
                if st is None or st.length + 1 != len(sl):  # new, or re-admitted (its slots may have moved)
                    st = self.states[sid] = SeqState([LayerState() for _ in range(self.num_layers)])
                st.step += 1
                st.length = len(sl)
        self.batch = _Batch(list(ids), list(slots), sparse, [None] * len(ids))
        self.stats.steps += 1
        return True

    def run(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out):
        """out[b] = attention of q[b] [Hq, D] over the keys this step's plan gives each KV head."""
        b = self.batch
        B, hq, d = q.shape
        hkv = k_cache.shape[1]
        g = hq // hkv
        if b.heads is None or b.heads.shape[0] != hkv:
            b.heads = torch.arange(hkv, device=k_cache.device)[:, None]
        heads = b.heads
        parts, lens = [], []
        for i, sid in enumerate(b.ids):
            slots = b.slots[i]
            L = len(slots)
            if not b.sparse[i]:
                if b.dense_index[i] is None:  # the same in every layer
                    b.dense_index[i] = (slots[None] * hkv + heads).flatten()
                parts.append(b.dense_index[i])
                lens.append(L)
                continue
            st = self.states[sid].layers[layer]
            qi = q[i].view(hkv, g, d)
            seq = SeqKeys(
                lambda a, e, s=slots: k_cache[s[a:e]], L, st, self.p.logical_page, self.folder(k_cache, slots)
            )
            chosen = self.policy.choose(st, self.states[sid].step, qi, seq, scale)
            if chosen is not None:
                st.pages, st.sel_len = chosen
                st.selected_at = self.states[sid].step
                st.index = self.rows_of(st.pages, slots, st.sel_len, heads)
            index = st.index
            if st.sel_len < L:
                tail = b.tails.get((i, st.sel_len))
                if tail is None:
                    tail = b.tails[(i, st.sel_len)] = slots[None, st.sel_len :] * hkv + heads
                index = torch.cat([index, tail], dim=1)
            self.stats.selected_tokens += index.numel()
            self.stats.context_tokens += L * hkv
            parts.append(index.flatten())
            lens.append(index.shape[1])
        indptr = torch.tensor(list(accumulate((n for n in lens for _ in range(hkv)), initial=0)), dtype=torch.int64)
        if self.keep_index:
            self.last_index = parts
        indices = torch.cat(parts)
        name = self.executor_for(k_cache)
        if name == "native":
            qv, o = q.reshape(B * hkv, g, d), out.view(B * hkv, g, -1)
            kf, vf = k_cache.view(-1, 1, d), v_cache.view(-1, 1, v_cache.shape[-1])
            oc = o if o.is_contiguous() else torch.empty_like(o)
            self.native.paged_decode(qv.contiguous(), kf, vf, indices, indptr, scale, oc, DECODE_MIN_SPLIT)
            if oc is not o:
                o.copy_(oc)
            return out
        if self._interface is None:
            self._interface = interface_executor(name)
        dev = k_cache.device
        return self._interface(q, k_cache, v_cache, indptr.to(dev), indices.to(dev) // hkv, scale, out)

    def rows_of(self, pages: torch.Tensor, slots: torch.Tensor, length: int, heads: torch.Tensor) -> torch.Tensor:
        """The plan rows [Hkv, m] (``slot * Hkv + h``) of the positions below ``length`` of ``pages``."""
        if self._page_rows is not None and slots.device.type == "cpu" and slots.dtype == torch.int64:
            return self._page_rows(pages.contiguous(), slots.contiguous(), self.p.page_size, length)
        return slots[pages_to_positions(pages, self.p.page_size, length)] * heads.shape[0] + heads

    def folder(self, k_cache: torch.Tensor, slots: torch.Tensor):
        """The native in-place summary update for this sequence's keys, or None (torch path)."""
        native, lp = self._update_summaries, self.p.logical_page
        if native is None or k_cache.device.type != "cpu" or slots.dtype != torch.int64 or not slots.is_contiguous():
            return None
        return lambda buf, a, e: native(buf, k_cache, slots, a, e, lp)

    def executor_for(self, k_cache: torch.Tensor) -> str:
        if self.executor != "auto":
            return self.executor
        if k_cache.device.type == "cpu":
            return "native" if self.native is not None else "reference"
        return "triton" if k_cache.device.type == "cuda" else "reference"


def interface_executor(name: str):
    """The executors of the GPU interface (:mod:`sgl_loopkv.attention.decode_gpu`):
    ``f(q, k_cache, v_cache, head_indptr, head_slots, scale, out)``."""
    if name == "reference":
        from sgl_loopkv.attention.decode_gpu import sparse_decode_reference

        return sparse_decode_reference
    if name == "triton":
        from sgl_loopkv.kernels.sparse_decode_triton import sparse_decode_triton

        return sparse_decode_triton
    if name == "flashinfer":
        from sgl_loopkv.attention.decode_gpu import FlashInferSparseDecode

        return FlashInferSparseDecode()
    raise ValueError(f"unknown sparse decode executor {name!r}")
