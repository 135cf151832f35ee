"""SGLang glue: ``--radix-cache-backend loopkv``, a radix cache whose nodes keep KV on device,
in the host arena and on disk.

It subclasses SGLang's own ``RadixCache``: matching, locking, ``checkpoint`` and device eviction
are SGLang's. The tree does the bookkeeping; each other job is a small collaborator it owns:

- a node carries its stored extent (:mod:`~sgl_loopkv.cache.node`, which also maps a segment back
  to its nodes) once its KV is written through at the request's final ``checkpoint``
  (:mod:`~sgl_loopkv.cache.write_through`): the tiers hold every conversation's history, the
  device pool caches;
- device eviction drops only the device copy of a stored node; the node stays in the tree.
  Invariant (as in SGLang's HiCache): a node on the device has its parent on the device;
- ``match_prefix`` walks past the device part into stored nodes, asks the shared disk for what
  the tree lacks (:mod:`~sgl_loopkv.cache.discovery`: another worker's turns, or this worker's
  before a restart; nothing is rebuilt at start-up), then loads them back
  (:mod:`~sgl_loopkv.cache.load_back`) or, for a long history under a budget, admits a
  chunk-pruned restore (:mod:`~sgl_loopkv.cache.pruned_admission`);
- every background thread (the loader, the chunk reader, the store's disk writers and readers)
  belongs to the store's I/O controller (:mod:`~sgl_loopkv.cache.io_controller`): one start, one close.

Reused from SGLang: the tree, RadixKey namespacing, eviction strategies, the KV pool and its
allocator. Built here: tiers, on-disk layout, layer-wise loader, value policy. SGLang's HiCache
(UnifiedRadixCache + HiCacheController + HostKVCache) is not reused: its host pool stores whole
pages of all layers and its scheduler hooks only run with ``--enable-hierarchical-cache``, while
this store needs chunk-addressable per-layer extents for the compression and pruning issues.
Chunk size = ``--page-size`` (16), so node boundaries are chunk boundaries.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from dataclasses import replace

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_loopkv.cache import retention
from sgl_loopkv.cache.address import chunk_chain, namespace
from sgl_loopkv.cache.discovery import SharedDiskDiscovery
from sgl_loopkv.cache.forget import apply_notes as apply_forget_notes
from sgl_loopkv.cache.importance import ChunkImportance
from sgl_loopkv.cache.layout import KVGeometry
from sgl_loopkv.cache.load_back import LoadBack
from sgl_loopkv.cache.metrics import TierMetrics
from sgl_loopkv.cache.node import SegmentNodes, ref_of, tokens
from sgl_loopkv.cache.prefix_config import PrefixConfig
from sgl_loopkv.cache.pruned import PrunedRestore, PrunedStats
from sgl_loopkv.cache.pruned_admission import PrunedAdmission
from sgl_loopkv.cache.requests import RequestStates
from sgl_loopkv.cache.segment_record import FORMAT_VERSION
from sgl_loopkv.cache.sharing import LayerSharing
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.write_through import WriteThrough
from sgl_loopkv.platform import release_free_heap
from sgl_loopkv.restore.restorer import Restorer

logger = logging.getLogger(__name__)


class LoopKVRadixCache(RadixCache):
    def __init__(
        self,
        params,
        *,
        kv_pool,
        store_factory,
        importance: ChunkImportance | None = None,
        restorer: Restorer | None = None,
        sharing: LayerSharing | None = None,
        store_dtype: torch.dtype | None = None,
        prefix: PrefixConfig | None = None,
    ):
        super().__init__(params)  # calls reset(), which skips the tiers until they exist
        assert self.page_size > 1, "loopkv needs --page-size = chunk size (e.g. 16)"
        self.restorer = restorer or Restorer("load_all")
        self.sharing = sharing
        self.kv_pool = kv_pool
        self.geometry = KVGeometry(
            num_layers=len(kv_pool.k_buffer),
            num_kv_heads=kv_pool.k_buffer[0].shape[1],
            head_dim=kv_pool.k_buffer[0].shape[2],
            dtype=kv_pool.k_buffer[0].dtype,
            chunk_tokens=self.page_size,
        )
        self.seg_nodes = SegmentNodes(self)
        self.requests = RequestStates()  # per request: its loads, lookups, hold-backs, pin, pruned restore
        # The tiers may keep KV in a narrower dtype than the pool (--loopkv-tier-store-dtype): their geometry
        # (disk layout, directory key) is the stored one; loads cast back to the pool's dtype.
        self.store_geometry = replace(self.geometry, dtype=store_dtype or self.geometry.dtype)
        self.store: TieredKVStore = store_factory(self.store_geometry, self.seg_nodes.lost)
        self.io = self.store.io  # every background thread (loader, chunk reader too): one start, one close
        self.load_back = LoadBack(self)
        self.loader = self.load_back.loader
        # An opaque name of this worker process (not its host name or pid) for responses behind a router.
        self.worker_id = hashlib.blake2b(f"{socket.gethostname()}:{os.getpid()}".encode(), digest_size=4).hexdigest()
        self.metrics = TierMetrics(params.enable_metrics)
        self.importance = importance or ChunkImportance()
        self.importance.configure(self.geometry.num_layers // 2, self.page_size)
        self.prefix = prefix or PrefixConfig()
        self.write_through = WriteThrough(self)
        self.discovery = SharedDiskDiscovery(self)
        self.pruned_admission = PrunedAdmission(self)

    @property
    def pruned(self) -> dict[str, PrunedRestore]:
        """rid -> its chunk-pruned restore, while one is held (queued or running)."""
        return self.pruned_admission.jobs

    @property
    def pruned_stats(self) -> PrunedStats:
        return self.pruned_admission.stats

    # --- bookkeeping ---------------------------------------------------------------------------
    def reset(self):
        super().reset()
        if not hasattr(self, "store"):  # from RadixCache.__init__: the tiers are not built yet
            return
        self.write_through.reset()  # /flush_cache: every tier, and the turns not stored yet
        for seg_id in list(self.store.segments):
            self.store.drop(seg_id)
        self.seg_nodes.clear()
        self.metrics.publish(self.store.count_tokens())  # else /metrics shows the old tiers until the next turn
        release_free_heap()

    def chain(self, token_ids, key: RadixKey) -> list[str]:
        """Chain hashes of the whole chunks of ``token_ids`` in ``key``'s namespace (extra key, salt).
        The stored form is part of it: the tier's dtype (in the geometry) and the layer-sharing codec,
        so a worker never loads KV another stored more lossily than it would itself."""
        return chunk_chain(token_ids, self.page_size, self.namespace_root(key.extra_key, key.cache_salt))

    def namespace_root(self, extra_key: str | None, cache_salt: str | None) -> bytes:
        """The hash chain's root for histories of this extra key and salt (:func:`address.namespace`)."""
        stored_form = {**self.store_geometry.to_json(), "share_layers": self.sharing.codec if self.sharing else None}
        return namespace(FORMAT_VERSION, stored_form, extra_key, cache_salt)

    # --- write-through at checkpoint ------------------------------------------------------------
    def checkpoint(self, req, *, up_to: int):
        job = self.pruned_admission.jobs.get(req.rid)
        if job is not None:  # its history's slots hold only the chunks some period kept: not the tree's
            if not self.disable and req.finished():
                self.write_through.pruned_turn_end(req, job, up_to)
            return
        super().checkpoint(req, up_to=up_to)
        if not self.disable and req.finished() and req.last_node is not None:
            self.write_through.turn_end(req)  # stored at flush_pending_backups, after the last token

    def queue_backup(
        self,
        node: TreeNode,
        pairs: list[tuple[int, int]],
        mass: torch.Tensor | None,
        hint: retention.Retention = retention.DEFAULT,
        rid: str | None = None,
    ) -> None:
        """Store the path to ``node`` at the next :meth:`flush_pending_backups` (:meth:`WriteThrough.queue`)."""
        self.write_through.queue(node, pairs, mass, hint, rid)

    def flush_pending_backups(self) -> None:
        """SGLang's seam for deferred host backups (called after a batch's outputs are streamed, and
        by :meth:`evict` first): the finished turns go to the tiers now, and what their chunk-pruned
        restores read from disk to the host chunk cache."""
        self.write_through.flush()

    # --- device eviction keeps stored nodes -------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """SGLang's eviction after the loads in flight finished (never free slots a load is still
        writing). A stored leaf only loses its device copy (:meth:`_delete_leaf`) and stays as a
        child, so its parent becomes evictable for the next pass: passes repeat until enough."""
        if self.disable:
            return EvictResult()
        self.flush_pending_backups()  # a finished turn is stored before its nodes can be evicted
        self.loader.wait_all()  # on a GPU also orders the forward's stream after the copies
        evicted = 0
        while evicted < params.num_tokens:
            n = super().evict(replace(params, num_tokens=params.num_tokens - evicted)).num_tokens_evicted
            if n == 0:
                break
            evicted += n
        return EvictResult(num_tokens_evicted=evicted)

    def _delete_leaf(self, node: TreeNode) -> None:
        """Called by SGLang's ``evict`` once the leaf's slots are freed: a node whose KV lives on in
        the host/disk tiers stays in the tree without a device copy; any other is removed."""
        ref = ref_of(node)
        if ref is not None and self.store.tier_of(ref[0]) is not None:
            node.value = None
            self.evictable_size_ -= len(node.key)
            self.evictable_leaves.discard(node)
            self._update_leaf_status(node.parent)
            return
        self.seg_nodes.discard(node)
        # Its stored children (if its own segment was lost while it was on the device) would be
        # orphaned below a deleted node, and losing their segments later would put that deleted
        # node, whose slots are already freed, back among the evictable leaves: drop them now.
        for child in list(node.children.values()):
            self.seg_nodes.drop_subtree(child)
        super()._delete_leaf(node)

    def insert(self, params: InsertParams) -> InsertResult:
        """SGLang's insert, after every stored-only (evicted) node on the path adopted the request's
        freshly computed slots. The returned prefix length counts only what was already on the
        device, which is what the caller frees (device nodes come first on a path: a node on the
        device has its parent on the device)."""
        if self.disable or params.value is None:
            return super().insert(params)
        key, value = params.key.maybe_to_bigram_view(self.is_eagle, params.value)
        key = key.page_aligned(self.page_size)
        node, pos, device_prefix = self.root_node, 0, 0
        while pos < len(key):
            child = node.children.get(key[pos:].child_key(self.page_size))
            if child is None:
                break
            plen = child.key.match(key[pos:], page_size=self.page_size)
            if plen < len(child.key):
                child = self._split_node(child.key, child, plen)
            if child.evicted:
                child.value = value[pos : pos + plen].clone()
                self.evictable_size_ += plen
                self._update_leaf_status(child)
                self._update_leaf_status(child.parent)
            else:
                device_prefix += plen
            node, pos = child, pos + plen
        return replace(super().insert(params), prefix_len=device_prefix)

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int):
        """SGLang's split, for nodes whose device copy may be gone and whose stored copy is split
        at the same (chunk-aligned) boundary."""
        ref, value = ref_of(child), child.value
        if value is None:
            child.value = torch.empty(len(child.key), dtype=torch.int64)  # placeholder for super()
        new_node = super()._split_node(key, child, split_len)
        if value is None:
            new_node.value = child.value = None
        new_node.lkv = None
        if ref is not None:
            seg, lo, hi = ref
            mid = lo + split_len // self.page_size
            self.seg_nodes.set_ref(new_node, (seg, lo, mid))
            self.seg_nodes.set_ref(child, (seg, mid, hi))
        return new_node

    # --- match: device part, then the stored part loaded back ---------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        if self.disable or len(key) == 0:
            return self._empty_match_result
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._empty_match_result
        t_lookup = time.perf_counter()
        self.store.sync()  # evictions the disk writer made: their nodes go before the walk
        if self.store.disk is not None:
            apply_forget_notes(self)  # another worker's forgets: this worker's copies go before the walk
        device_len, last_device, stored = self._walk(key)
        req = getattr(params, "req", None)
        if req is not None and self.store.disk is not None:
            self.requests.of(req.rid).probed = True
            end = stored[-1] if stored else last_device
            stored += self.discovery.discover(key, end, device_len + tokens(stored), req.rid)
        self.pruned_admission.drop_unadopted()
        if stored and req is not None and self.pruned_admission.prunes(stored):
            job = self.pruned_admission.admit(stored, last_device, req, device_len, key)
            if job is not None:
                # The history's row entries point at the padding slot (the plans list the page
                # cache instead): SGLang must not free them, and on_release frees the cache.
                n = device_len + job.tokens
                return _match(n, last_device, cache_protected_len=n)
            # loads the tree's way: what is still stored (a bad segment ends the history there)
            keep = next(
                (i for i, nd in enumerate(stored) if ref_of(nd) is None or not self.seg_nodes.attached(nd)), len(stored)
            )
            stored = stored[:keep]
        if stored and req is not None:
            state = self.requests.get(req.rid)
            if state is not None and state.probing and self.discovery.reads_ahead(stored, req.rid):
                return _match(device_len, last_device)  # held back this round: what the device holds
            self.restorer.add_seconds("lookup", time.perf_counter() - t_lookup)
            self.discovery.admitted(req.rid)
            loaded, last_device = self.load_back.load(stored, last_device, req, device_len, len(key))
            device_len += loaded
            self.metrics.publish(self.store.count_tokens())
            self.metrics.publish_restore(self.restorer.stats)
        return _match(device_len, last_device)

    def _walk(self, key: RadixKey) -> tuple[int, TreeNode, list[TreeNode]]:
        now = time.monotonic()
        node = self.root_node
        node.last_access_time = now
        device_len, last_device, stored = 0, node, []
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            child.last_access_time = now
            plen = child.key.match(key, page_size=self.page_size)
            if plen < len(child.key):
                child = self._split_node(child.key, child, plen)
            if not child.evicted and not stored:
                device_len += len(child.value)
                last_device = child
            elif child.evicted and ref_of(child) is not None and self.store.tier_of(ref_of(child)[0]) is not None:
                stored.append(child)
            else:
                break
            node, key = child, key[plen:]
            if plen < len(child.key):
                break
        return device_len, last_device, stored

    def awaits_write(self, req) -> bool:
        """Whether the scheduler should hold ``req`` back this round (:meth:`SharedDiskDiscovery.awaits_write`)."""
        return self.discovery.awaits_write(req)

    def pace_reads(self, busy: bool) -> None:
        """The scheduler, each round it holds requests back: whether others are running (:meth:`TieredKVStore.pace_reads`)."""
        self.store.pace_reads(busy)

    # --- chunk-pruned restores: the request's row and its lifetime --------------------------------
    def prefix_device_indices(self, req) -> torch.Tensor:
        """SGLang's path indices, then the pruned history's positions (:meth:`PrunedAdmission.row_prefix`:
        as SGLang's LMCache connector appends slots it loaded but did not publish, this appends what
        the tree lacks)."""
        job = self.pruned_admission.jobs.get(req.rid)
        if job is None:
            return super().prefix_device_indices(req)
        indices = self.pruned_admission.row_prefix(self.path_device_indices(req.last_node), job)
        assert len(indices) == req.prefix_len, (req.rid, len(indices), req.prefix_len)
        return indices

    def maybe_hand_to_session(self, req) -> None:
        """SGLang calls this once the request's row was written (after :meth:`prefix_device_indices`):
        a pruned restore is the running request's from now on."""
        super().maybe_hand_to_session(req)
        self.pruned_admission.adopt(req.rid)

    def pruned_job(self, rid: str) -> PrunedRestore | None:
        """The running request's pruned restore (the attention backend asks for every sequence)."""
        return self.pruned_admission.jobs.get(rid)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self.pruned_admission.release(req.rid)

    def tier_breakdown(self, rid: str, cached_tokens: int) -> dict[str, int]:
        """Cached tokens of request ``rid`` by the tier they came from (:meth:`LoadBack.tier_breakdown`)."""
        return self.load_back.tier_breakdown(rid, cached_tokens)


def _match(device_len: int, last_device: TreeNode, **extra) -> MatchResult:
    return MatchResult(
        device_prefix_len=device_len,
        last_device_node=last_device,
        last_host_node=last_device,
        best_match_node=last_device,
        **extra,
    )
