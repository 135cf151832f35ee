"""SGLang glue: ``--radix-cache-backend loopkv``, a radix cache whose nodes keep KV on device,
in the host arena and on disk.

It subclasses SGLang's own ``RadixCache``: matching, locking, ``checkpoint`` and device eviction
are SGLang's. What changes:

- A node carries ``lkv = (segment id, first chunk, end chunk)`` once its KV is stored (written
  through at the request's final ``checkpoint``: the tiers hold every conversation's history, the
  device pool caches).
- Device eviction drops only the device copy of a stored node; the node stays in the tree.
  Invariant (as in SGLang's HiCache): a node on the device has its parent on the device.
- ``match_prefix`` walks past the device part into stored nodes and loads them back: host (or
  disk, verified then promoted to host) -> new device slots, layer by layer on the loader thread
  (:mod:`sgl_loopkv.cache.loader`), before the request's extend reads them. A corrupt or missing
  segment ends the match there; that history is recomputed.
- The disk tier is shared by every worker of a cluster and content-addressed
  (:mod:`sgl_loopkv.cache.address`): a stored segment's name derives from the history it holds.
  When the tree has no more of a prompt, ``match_prefix`` asks the disk for the next chunk by its
  chain hash and hangs what it finds (another worker's turns, or this worker's before a restart)
  into the tree as stored nodes, which then load like any other. So nothing is rebuilt at start-up:
  a restarted worker finds every stored history on its first request for it.

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
import math
import os
import socket
import time
from array import array
from collections import OrderedDict, defaultdict
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
from sgl_loopkv.cache.address import chunk_chain, namespace, segment_id
from sgl_loopkv.cache.copy_stream import pinned_host
from sgl_loopkv.cache.disk import Found
from sgl_loopkv.cache.disk_announce import Announced
from sgl_loopkv.cache.forget import apply_notes as apply_forget_notes
from sgl_loopkv.cache.importance import ChunkImportance
from sgl_loopkv.cache.layout import KVGeometry, key_summaries
from sgl_loopkv.cache.loader import LayerwiseLoader, LoadPart, beside_forward
from sgl_loopkv.cache.metrics import TierMetrics
from sgl_loopkv.cache.pruned import (
    ChunkReader,
    KVBuffers,
    PrunedHistory,
    PrunedParams,
    PrunedRestore,
    PrunedStats,
    Source,
)
from sgl_loopkv.cache.requests import RequestState, RequestStates
from sgl_loopkv.cache.segment_record import FORMAT_VERSION, CorruptSegment, SegmentRecord
from sgl_loopkv.cache.sharing import LayerSharing
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.config import PrefixConfig
from sgl_loopkv.platform import release_free_heap, torch_single_threaded
from sgl_loopkv.restore.plan import RestoreJob, RestorePlan
from sgl_loopkv.restore.restorer import Restorer

logger = logging.getLogger(__name__)

TRIM_EVERY_S = 5.0  # the C heap's free pages go back to the OS at most this often (at a turn's end)
# A waiting request is matched again at every scheduling round: its shared-disk lookup (a hash chain
# over the prompt, an open per segment) is redone at most this often for the same position.
RELOOK_S = 1.0
# A pruned restore made for a waiting request that never ran (aborted while queued) gives its slots
# back after this long without being matched again (a waiting request is re-matched every round).
UNADOPTED_S = 30.0
UNSALTED = "loopkv-unsalted-"  # the salt prefix --loopkv-require-salt gives requests that bring none (server/salt.py)
# A request whose history is read ahead from disk (cache/prefetch.py) is held back at most this long,
# then reads inline like before (a read slower than this is a disk in trouble, not a queue).
READ_AHEAD_WAIT_S = 30.0
READ_AHEAD = "<disk read ahead>"  # what RequestState.awaiting names (announced chunks: their hash)
PADDING_SLOT = 0  # SGLang's allocators never hand out the pool's first page: dummy writes land there


def _ref(node: TreeNode) -> tuple[str, int, int] | None:
    return getattr(node, "lkv", None)


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
        self.store: TieredKVStore | None = None  # RadixCache.__init__ calls reset()
        self.restorer = restorer or Restorer("load_all")
        self.sharing = sharing
        super().__init__(params)
        assert self.page_size > 1, "loopkv needs --page-size = chunk size (e.g. 16)"
        self.kv_pool = kv_pool
        self.geometry = KVGeometry(
            num_layers=len(kv_pool.k_buffer),
            num_kv_heads=kv_pool.k_buffer[0].shape[1],
            head_dim=kv_pool.k_buffer[0].shape[2],
            dtype=kv_pool.k_buffer[0].dtype,
            chunk_tokens=self.page_size,
        )
        self.loader = LayerwiseLoader(
            kv_pool.k_buffer,
            kv_pool.v_buffer,
            synchronous=not beside_forward(kv_pool.k_buffer[0].device),
            on_copy=self.restorer.observe_copy,
            on_wait=self.restorer.observe_bubble,
        )
        # The pool's get_key_buffer/get_value_buffer wait on it: layer-wise loads overlap the forward
        # under every attention backend.
        kv_pool.register_layer_transfer_counter(self.loader)
        logger.info(
            "loopkv: %s (the KV pool's layer transfer counter)",
            "loads run before the forward" if self.loader.synchronous else "layer-wise loads overlap the forward",
        )
        self._seg_nodes: dict[str, set[TreeNode]] = defaultdict(set)
        self.requests = RequestStates()  # per request: its loads, lookups, hold-backs, pin, pruned restore
        self._probing = False  # in awaits_write's lookup: a request may be held back for its disk reads
        self._trimmed_at = 0.0
        # The tiers may keep KV in a narrower dtype than the pool (--loopkv-store-dtype): their geometry
        # (disk layout, directory key) is the stored one; loads cast back to the pool's dtype.
        self.store_geometry = replace(self.geometry, dtype=store_dtype or self.geometry.dtype)
        self.store = store_factory(self.store_geometry, self._on_segment_lost)
        # An opaque name of this worker process (not its host name or pid) for responses behind a router.
        self.worker_id = hashlib.blake2b(f"{socket.gethostname()}:{os.getpid()}".encode(), digest_size=4).hexdigest()
        self.metrics = TierMetrics(params.enable_metrics)
        self.importance = importance or ChunkImportance()
        self.importance.configure(self.geometry.num_layers // 2, self.page_size)
        self.prefix = prefix or PrefixConfig()
        self.pruned: OrderedDict[str, PrunedRestore] = OrderedDict()  # rid -> its chunk-pruned restore
        self.pruned_adopted: set[str] = set()  # rids whose row holds their restore's slots
        self.pruned_stats = PrunedStats()  # every finished pruned restore, summed
        self.chunk_reader = ChunkReader()
        if self.prefix.enabled and self.store.disk is not None:
            from sgl_loopkv.kernels import chunk_io

            chunk_io.load()  # built (first start on a machine) or loaded now, not at a restore's first read

    # --- bookkeeping ---------------------------------------------------------------------------
    def set_ref(self, node: TreeNode, ref: tuple[str, int, int] | None) -> None:
        old = _ref(node)
        if old is not None:
            self._seg_nodes[old[0]].discard(node)
        node.lkv = ref
        if ref is not None:
            self._seg_nodes[ref[0]].add(node)

    def _on_segment_lost(self, seg_id: str) -> None:
        for node in list(self._seg_nodes.pop(seg_id, ())):
            node.lkv = None
            if node.evicted:
                self._drop_subtree(node)

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove an evicted node whose KV is gone, with everything below it (unreachable now)."""
        for child in list(node.children.values()):
            self._drop_subtree(child)
        ref = _ref(node)
        if ref is not None:
            self._seg_nodes[ref[0]].discard(node)
        if node.parent is not None and node.parent.children.get(node.key.child_key(self.page_size)) is node:
            del node.parent.children[node.key.child_key(self.page_size)]
            self._update_leaf_status(node.parent)

    def reset(self):
        # finished turns not stored yet: (tree lock on the turn's last node, layer pairs, chunk mass)
        self._backups: list[tuple] = []
        self._offering: list[PrunedRestore] = []  # done restores whose disk reads go to the chunk cache
        super().reset()
        if self.store is not None:  # /flush_cache: every tier
            for seg_id in list(self.store.segments):
                self.store.drop(seg_id)
            self._seg_nodes.clear()
            self.metrics.publish(self.store.count_tokens())  # else /metrics shows the old tiers until the next turn
            release_free_heap()

    # --- write-through at checkpoint ------------------------------------------------------------
    def checkpoint(self, req, *, up_to: int):
        job = self.pruned.get(req.rid)
        if job is not None:  # its history's slots hold only the chunks some period kept: not the tree's
            if not self.disable and req.finished():  # now, not deferred: on_release frees its page cache
                if retention.of_request(req).retain != "none":  # a pin is not applied on this path (yet)
                    self._store_pruned_turn(req, job, up_to)
                self.importance.pop(req.kv.req_pool_idx)
                self.metrics.publish(self.store.count_tokens())
            return
        super().checkpoint(req, up_to=up_to)
        # Store when the turn ends, not at every prefill chunk (the copy would cost the first
        # token's latency), and after its last token is out: queued here under a tree lock (nothing
        # it computed can be evicted before it is stored), stored by flush_pending_backups, which
        # SGLang calls once the batch's outputs are streamed (the store held the last token 0.2-0.5 s
        # at 2K new tokens, most with int8 tiers: docs/decisions/2026-11-26-store-after-the-last-token.md).
        # What needs the request's row (its layer pairs, its chunk importance) is taken now.
        if not self.disable and req.finished() and req.last_node is not None:
            pairs = self.sharing.turn_end(req.kv.req_pool_idx, req.last_node, self.root_node) if self.sharing else []
            mass = self.importance.pop(req.kv.req_pool_idx)
            hint = retention.of_request(req)
            if hint.retain != "none":  # "none": its KV stays in the device tree only (cache.retention)
                self.queue_backup(req.last_node, pairs, mass, hint, req.rid)
            if hint.retain == "pin":  # stored now, before its last token is streamed: the answer says if it pinned
                self.flush_pending_backups()

    def queue_backup(
        self,
        node: TreeNode,
        pairs: list[tuple[int, int]],
        mass: torch.Tensor | None,
        hint: retention.Retention = retention.DEFAULT,
        rid: str | None = None,
    ) -> None:
        """Store the path to ``node`` at the next :meth:`flush_pending_backups`; locked until then.
        Its segments are announced on the shared disk tier now, before the last token goes out: the
        conversation's next turn may reach another worker first, whose lookup then waits for them."""
        announced = []  # only announced: the flush derives the records again, since another turn
        # of the same batch may split these nodes before it (their records would change)
        if self.store.disk is not None:
            for n in self._unstored_path(node):
                record = self._record_of(n)
                self.store.disk.announce(record)
                announced.append((n, record))
        self._backups.append((self.lock(node), pairs, mass, announced, hint, rid))

    def flush_pending_backups(self) -> None:
        """SGLang's seam for deferred host backups (called after a batch's outputs are streamed, and
        by :meth:`evict` first): the finished turns go to the tiers now, and what their chunk-pruned
        restores read from disk to the host chunk cache."""
        offering, self._offering = self._offering, []
        backups, self._backups = self._backups, []
        if not (offering or backups):  # most calls (every decode step)
            return
        with torch_single_threaded():  # bulk copies while the next request is being tokenized
            for job in offering:
                job.offer_reads()
            for lock, pairs, mass, announced, hint, rid in backups:
                try:
                    self._store_path(lock.node, pairs)
                    self._touch_path(lock.node, mass)
                    if hint.retain == "pin":
                        outcome = retention.pin_outcome(retention.pin_path(self, lock.node, hint.ttl_s))
                        self.requests.of(rid).pin = outcome
                finally:
                    self.unlock(lock)
                    for n, record in announced:  # not stored under that name: lookups stop waiting for it
                        ref = _ref(n)
                        if ref is None or ref[0] != record.seg_id:
                            self.store.disk.unannounce(record)
        if not backups:
            return
        self.restorer.ensure_calibrated(self.geometry.token_bytes_per_layer, self.kv_pool.k_buffer[0].device)
        self.metrics.publish(self.store.count_tokens())
        self.metrics.publish_restore(self.restorer.stats)  # the bubbles of these turns' forwards
        if time.monotonic() - self._trimmed_at > TRIM_EVERY_S:  # the tiers' freed tensors leave the RSS
            release_free_heap()
            self._trimmed_at = time.monotonic()

    def _store_path(self, node: TreeNode, pairs: list[tuple[int, int]]) -> None:
        for n in self._unstored_path(node):
            if not self._store_node(n, pairs):
                return

    def _unstored_path(self, node: TreeNode) -> list[TreeNode]:
        """The device nodes above ``node`` (itself included) not stored yet, root first (a segment's
        parent must be stored before it)."""
        path = []
        while node is not self.root_node and _ref(node) is None and not node.evicted:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _touch_path(self, node: TreeNode, mass: torch.Tensor | None) -> None:
        """A turn used its whole history: one access for every stored segment on the path, weighted
        by the chunk attention mass the turn measured (uniform when none was measured)."""
        path = []
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        if mass is not None and float(mass.sum()) > 0:
            mass = mass * (len(mass) / float(mass.sum()))  # mean 1 per chunk over the attended history
        per_segment: dict[str, torch.Tensor | None] = {}
        pos = 0
        for n in reversed(path):
            ref = _ref(n)
            if ref is not None:
                seg, lo, hi = ref
                rec = self.store.segments.get(seg)
                if rec is not None:
                    if mass is None:
                        per_segment.setdefault(seg, None)
                    else:
                        vec = per_segment.get(seg)
                        vec = torch.zeros(rec.record.n_chunks) if vec is None else vec
                        part = mass[pos // self.page_size : (pos + len(n.key)) // self.page_size]
                        vec[lo : lo + len(part)] += part
                        per_segment[seg] = vec
            pos += len(n.key)
        for seg, vec in per_segment.items():
            self.store.touch(
                seg, self.store.segments[seg].record.n_chunks, vec if vec is not None and vec.sum() > 0 else None
            )
        self.store.touch_disk(per_segment)  # the shared tier's LRU: whole path at once, any worker sees it

    def _attached(self, node: TreeNode) -> bool:
        """Whether ``node`` is still reachable from the root (a dropped subtree keeps its parent links)."""
        while node is not self.root_node:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            node = parent
        return True

    def _position(self, node: TreeNode) -> int:
        pos, node = 0, node.parent
        while node is not self.root_node:
            pos += len(node.key)
            node = node.parent
        return pos

    def _history(self, node: TreeNode) -> list[int]:
        """Token ids from the root to the end of ``node``."""
        keys = []
        while node is not self.root_node:
            keys.append(node.key.raw_token_ids())
            node = node.parent
        return [t for k in reversed(keys) for t in k]

    def _chain(self, token_ids, key: RadixKey) -> list[str]:
        """Chain hashes of the whole chunks of ``token_ids`` in ``key``'s namespace (extra key, salt).
        The stored form is part of it: the tier's dtype (in the geometry) and the layer-sharing codec,
        so a worker never loads KV another stored more lossily than it would itself."""
        return chunk_chain(token_ids, self.page_size, self.namespace_root(key.extra_key, key.cache_salt))

    def namespace_root(self, extra_key: str | None, cache_salt: str | None) -> bytes:
        """The hash chain's root for histories of this extra key and salt (:func:`address.namespace`)."""
        stored_form = {**self.store_geometry.to_json(), "share_layers": self.sharing.codec if self.sharing else None}
        return namespace(FORMAT_VERSION, stored_form, extra_key, cache_salt)

    def _store_node(self, node: TreeNode, pairs: list[tuple[int, int]]) -> bool:
        if (node.key.cache_salt or "").startswith(UNSALTED):
            return False  # --loopkv-require-salt: a request of its own namespace, which nothing could resume
        parent_ref = _ref(node.parent) if node.parent is not self.root_node else None
        if node.parent is not self.root_node and parent_ref is None:
            return False  # its prefix is not stored: it could never be matched from the tiers
        kv = self._gather(node.value)
        record = self._record_of(node)
        codec = self.sharing.codec if pairs else None
        if not self.store.put(record, kv, key_summaries(kv[:, 0], self.page_size), pairs, codec):
            return False
        self.set_ref(node, (record.seg_id, 0, record.n_chunks))
        return True

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The pool's KV of ``slots`` as [L, 2, T, H, D] on the host, gathered straight into one
        buffer (a stack of per-layer gathers copied every byte twice: a 2K-token turn's store took
        ~60 ms on the scheduler thread, a third of it the second copy)."""
        k0 = self.kv_pool.k_buffer[0]
        on_host = k0.device.type == "cpu"
        out = torch.empty(
            self.geometry.num_layers, 2, len(slots), *k0.shape[1:], dtype=k0.dtype, pin_memory=pinned_host(k0.device)
        )
        for layer in range(self.geometry.num_layers):
            for i, buf in enumerate((self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer])):
                if on_host:
                    torch.index_select(buf, 0, slots, out=out[layer, i])
                else:
                    out[layer, i].copy_(buf[slots])
        return out

    def _record_of(self, node: TreeNode) -> SegmentRecord:
        n_chunks = len(node.key) // self.page_size
        start = self._position(node)
        chain = self._chain(self._history(node), node.key)
        first = start // self.page_size
        return SegmentRecord(  # named by content: the same history stored by another worker is this file
            seg_id=segment_id(first, chain[-1]),
            parent=chain[first - 1] if first else None,
            start=start,
            n_chunks=n_chunks,
            file_bytes=0,
            extra_key=node.key.extra_key,
            cache_salt=node.key.cache_salt,
            token_ids=list(node.key.raw_token_ids()),
            chunk_hashes=chain[first:],
        )

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
        ref = _ref(node)
        if ref is not None and self.store.tier_of(ref[0]) is not None:
            node.value = None
            self.evictable_size_ -= len(node.key)
            self.evictable_leaves.discard(node)
            self._update_leaf_status(node.parent)
            return
        if ref is not None:
            self._seg_nodes[ref[0]].discard(node)
        # Its stored children (if its own segment was lost while it was on the device) would be
        # orphaned below a deleted node, and losing their segments later would put that deleted
        # node, whose slots are already freed, back among the evictable leaves: drop them now.
        for child in list(node.children.values()):
            self._drop_subtree(child)
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
        ref, value = _ref(child), child.value
        if value is None:
            child.value = torch.empty(len(child.key), dtype=torch.int64)  # placeholder for super()
        new_node = super()._split_node(key, child, split_len)
        if value is None:
            new_node.value = child.value = None
        new_node.lkv = None
        if ref is not None:
            seg, lo, hi = ref
            mid = lo + split_len // self.page_size
            self.set_ref(new_node, (seg, lo, mid))
            self.set_ref(child, (seg, mid, hi))
        return new_node

    # --- match: device part + load-back of stored part ----------------------------------------
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
        if getattr(params, "req", None) is not None and self.store.disk is not None:
            self.requests.of(params.req.rid).probed = True
            end = stored[-1] if stored else last_device
            stored += self._discover(key, end, device_len + sum(len(nd.key) for nd in stored), params.req.rid)
        req = getattr(params, "req", None)
        self._drop_unadopted()
        if stored and req is not None and self._prunes(stored):
            job = self._restore_pruned(stored, last_device, req, device_len, key)
            if job is None:  # loads the tree's way: what is still stored (a bad segment ends the history there)
                keep = next(
                    (i for i, nd in enumerate(stored) if _ref(nd) is None or not self._attached(nd)), len(stored)
                )
                stored = stored[:keep]
            else:
                return MatchResult(
                    device_prefix_len=device_len + job.tokens,
                    last_device_node=last_device,
                    last_host_node=last_device,
                    best_match_node=last_device,
                    # The history's row entries point at the padding slot (the plans list the page
                    # cache instead): SGLang must not free them, and on_release frees the cache.
                    cache_protected_len=device_len + job.tokens,
                )
        if stored and req is not None and self._probing and self._reads_ahead(stored, req.rid):
            return MatchResult(  # held back this round (awaits_write): only what the device holds
                device_prefix_len=device_len,
                last_device_node=last_device,
                last_host_node=last_device,
                best_match_node=last_device,
            )
        if stored and req is not None:
            self.restorer.add_seconds("lookup", time.perf_counter() - t_lookup)
            state = self.requests.get(req.rid)
            if state is not None and state.awaiting is not None and state.awaiting[0] == READ_AHEAD:
                # admitted after sitting out rounds while its disk read ran on the prefetch thread
                self.restorer.add_seconds("held", time.monotonic() - (state.awaiting[1] - READ_AHEAD_WAIT_S))
                state.awaiting = None
            loaded, last_device = self._load_back(stored, last_device, params.req, device_len, len(key))
            device_len += loaded
            self.metrics.publish(self.store.count_tokens())
            self.metrics.publish_restore(self.restorer.stats)
        return MatchResult(
            device_prefix_len=device_len,
            last_device_node=last_device,
            last_host_node=last_device,
            best_match_node=last_device,
        )

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
            elif child.evicted and _ref(child) is not None and self.store.tier_of(_ref(child)[0]) is not None:
                stored.append(child)
            else:
                break
            node, key = child, key[plen:]
            if plen < len(child.key):
                break
        return device_len, last_device, stored

    def _discover(self, key: RadixKey, node: TreeNode, pos: int, rid: str) -> list[TreeNode]:
        """Stored runs of ``key`` after position ``pos`` (where the tree's match ended, at ``node``)
        that the shared disk holds: found chunk by chunk (one ``open`` per stored segment), hung
        below ``node`` as stored nodes. Returns them, root first."""
        page = self.page_size
        if pos >= len(key) or key[pos:].child_key(page) in node.children:
            return []  # the tree knows this continuation (its copy is gone): not looked up again
        now, n = time.monotonic(), len(key) // page
        state = self.requests.of(rid)
        last = state.lookup
        if last is not None and last[0] == n and last[2] == pos and now - last[3] < RELOOK_S:
            return []  # the same request, still waiting: nothing found here a moment ago
        chain = last[1] if last is not None and last[0] == n else self._chain(key.raw_token_ids(), key)
        found_nodes = []
        while pos < len(key):
            found = self.store.disk.probe(chain, pos // page)
            if isinstance(found, Announced) and self._await(rid, chain[pos // page], found, now):
                state.lookup = (n, chain, pos, -math.inf)  # looked up again next round
                break
            self._stop_awaiting(rid)
            if not isinstance(found, Found):
                state.lookup = (n, chain, pos, now)
                break
            n = (found.hi - found.lo) * page
            self.store.register(found.record)
            new = TreeNode()
            new.parent, new.key, new.value = node, key[pos : pos + n], None
            node.children[new.key.child_key(page)] = new
            self.set_ref(new, (found.record.seg_id, found.lo, found.hi))
            found_nodes.append(new)
            node, pos = new, pos + n
        if found_nodes:
            logger.info(
                "loopkv: found %d stored tokens on the shared disk tier", sum(len(nd.key) for nd in found_nodes)
            )
        return found_nodes

    def _await(self, rid: str, chunk_hash: str, announced: Announced, now: float) -> bool:
        """The lookup of ``rid`` ended at a chunk another worker announced: whether to hold the
        request back for it (its budget counted from when this request first saw that announcement)."""
        state = self.requests.of(rid)
        prev = state.awaiting
        until = prev[1] if prev is not None and prev[0] == chunk_hash else now + announced.wait_s
        state.awaiting = (chunk_hash, until, now < until)
        return now < until

    def _reads_ahead(self, stored: list[TreeNode], rid: str) -> bool:
        """Whether ``rid`` sits this round out while its disk-only segments are read on the prefetch
        thread (:mod:`sgl_loopkv.cache.prefetch`), not inside this match on the scheduler thread.
        Never past ``READ_AHEAD_WAIT_S`` from its first wait: then it reads inline, as before."""
        if not any([self.store.read_ahead(_ref(nd)[0]) for nd in stored]):  # every read started, not just the first
            return False
        state = self.requests.of(rid)
        now, prev = time.monotonic(), state.awaiting
        if prev is None or prev[0] != READ_AHEAD:
            logger.info(
                "loopkv: reading %d stored tokens from disk ahead of their request (held in the queue meanwhile)",
                sum(len(nd.key) for nd in stored if self.store.tier_of(_ref(nd)[0]) == "disk"),
            )
        until = prev[1] if prev is not None and prev[0] == READ_AHEAD else now + READ_AHEAD_WAIT_S
        state.awaiting = (READ_AHEAD, until, now < until)
        return now < until

    def _stop_awaiting(self, rid: str) -> None:
        state = self.requests.get(rid)
        if state is not None and state.awaiting is not None and state.awaiting[2]:
            state.awaiting = (*state.awaiting[:2], False)

    def awaits_write(self, req) -> bool:
        """Whether the scheduler should hold ``req`` back this round: its history goes on in a
        segment that another worker announced and has not published yet, and waiting for it is
        still worth it (the announcement's budget, :meth:`DiskSegmentStore.probe`). A request seen
        for the first time, or one held back, is looked up here as its next match would (SGLang's
        ``init_next_round_input``): the hook that calls this runs before the scheduler matches and
        admits requests (:mod:`sgl_loopkv.cache.awaited`)."""
        if self.disable or self.store.disk is None:
            return False
        rid = req.rid
        state = self.requests.of(rid)
        if state.probed and (state.awaiting is None or not state.awaiting[2]):
            return False
        state.probed = True
        self._stop_awaiting(rid)  # the lookup below says it again if it still ends at an announcement
        self._probing = True  # a disk-only history is read ahead while the request waits, not in the match
        try:
            req.init_next_round_input(self)
        finally:
            self._probing = False
        return state.awaiting is not None and state.awaiting[2]

    # --- chunk-pruned restores (ContiguousKV, :mod:`sgl_loopkv.cache.pruned`) ---------------------
    def _prunes(self, stored: list[TreeNode]) -> bool:
        """Whether this history is restored chunk by chunk: pruning (or streaming) is on, the loopkv
        attention backend runs (it executes the kept-chunk plans) and the history is long enough."""
        cfg = self.prefix
        if not cfg.enabled or self.restorer.stack is None:
            return False
        return sum(len(nd.key) for nd in stored) >= cfg.min_tokens

    def _restore_pruned(
        self, stored: list[TreeNode], last_device: TreeNode, req, device_len: int, key
    ) -> PrunedRestore | None:
        """Slots for the stored history and a :class:`PrunedRestore` that fills them during the new
        turn's prefill. A waiting request matched again gets the restore it already has."""
        total = sum(len(nd.key) for nd in stored)
        t0 = time.perf_counter()
        job = self.pruned.get(req.rid)
        if job is not None:
            if job.start == device_len and job.tokens == total and req.rid not in self.pruned_adopted:
                job.last_used = time.monotonic()
                return job
            self._drop_pruned(req.rid, ran=req.rid in self.pruned_adopted)
        # Restores of requests still queued hold their slots outside the tree (nothing can evict
        # them): the first always, then up to half of the pool; past that a history loads the
        # tree's way, whose slots the scheduler can take back, so queued restores cannot starve
        # the requests that run.
        held = sum(j.cache_tokens for r, j in self.pruned.items() if r not in self.pruned_adopted)
        if held and held + self._cache_chunks(total // self.page_size) * self.page_size > self.kv_pool.size // 2:
            logger.info("loopkv: %d tokens of queued pruned restores: this history loads whole", held)
            return None
        sources, restoring, first = [], {_ref(nd)[0] for nd in stored}, 0
        summaries, admission_read = [], self.store.stats.disk_bytes_read
        # chunks are scored at each period's first layer only, and not at all when every chunk is kept
        scored = (
            list(range(0, self.geometry.num_layers, self.prefix.period))
            if self.prefix.budget < 1 and self.prefix.selection == "chunks"
            else []
        )
        try:
            for node in stored:
                seg, lo, hi = _ref(node)
                try:
                    host_kv, fd, header, summ, tier = self.store.chunk_source(
                        seg, lo, hi, scored, restoring, cache_summaries=self._caches_chunks()
                    )
                except CorruptSegment as e:
                    logger.warning("loopkv: %s; recomputing that part of the history", e)
                    break  # the node and its subtree went with the segment
                cache = self.store.chunk_cache if fd is not None and self._caches_chunks() else None
                sources.append(Source(seg, lo, hi, first, host_kv, fd, header, cache))
                summaries.append(summ)
                first += hi - lo
                tally = self.requests.of(req.rid).loads
                tally[tier] += len(node.key)
                if tier == "disk" and self.store.written_elsewhere(seg):
                    tally["shared"] += len(node.key)
                self.store.stats.hit_tokens[tier] += len(node.key)
            n = first * self.page_size
            if n == 0 or any(_ref(nd) is None or not self._attached(nd) for nd in stored[: len(sources)]):
                raise LookupError("part of the history was lost while it was restored")
            cfg = self.prefix
            slots = self._alloc(self._cache_chunks(first) * self.page_size, last_device)  # the page cache
            if slots is None:
                raise LookupError("no device slots for the history")
        except Exception as e:  # a history that cannot be restored is recomputed, never a crashed scheduler
            if isinstance(e, LookupError):
                logger.warning("loopkv: %s; recomputing it", e)
            else:
                logger.exception("loopkv: chunk-pruned admission failed; recomputing the history")
            for src in sources:
                if src.fd is not None:
                    os.close(src.fd)
            return None
        job = PrunedRestore(
            PrunedHistory(req.rid, sources, first, device_len, torch.cat(summaries, dim=1)),
            KVBuffers(self.kv_pool.k_buffer, self.kv_pool.v_buffer),
            self.chunk_reader,
            PrunedParams.from_config(cfg, self.page_size),
            disk=self.store.disk,
        )
        job.attach(slots)
        admitted = self.store.stats.disk_bytes_read - admission_read  # the scored layers' key summaries
        job.stats.summary_bytes_read = admitted
        job.stats.disk_bytes_read += admitted
        job.last_node = stored[len(sources) - 1]
        job.key = key
        self.pruned[req.rid] = job
        logger.info(
            "loopkv: resuming %d tokens chunk-pruned (budget %.2f: %d of %d chunks per period, every %d layers, "
            "in a page cache of %d device slots), read during the prefill; admitted in %.1f ms",
            n,
            cfg.budget,
            job.keep,
            job.n_chunks,
            cfg.period,
            job.cache_tokens,
            (time.perf_counter() - t0) * 1e3,
        )
        return job

    def _caches_chunks(self) -> bool:
        """Whether disk chunks a restore reads are offered to the host chunk cache: under a budget, with
        chunk selection (the IMPRESS-style baseline reads whole layers for its probe: not a working set)."""
        cfg = self.prefix
        return cfg.budget < 1 and cfg.selection == "chunks" and cfg.host_cache

    def _cache_chunks(self, n_chunks: int) -> int:
        return PrunedRestore.capacity_for(n_chunks, self.prefix.budget, self.prefix.selection)

    def prefix_device_indices(self, req) -> torch.Tensor:
        """SGLang's path indices, then the pruned history's positions, which hold no KV of their own:
        they point at the pool's padding slot (the allocator never hands out page 0), and the
        loopkv backend's plans read the restore's page cache for them instead (as SGLang's LMCache
        connector appends slots it loaded but did not publish, this appends what the tree lacks)."""
        job = self.pruned.get(req.rid)
        if job is None:
            return super().prefix_device_indices(req)
        path = self.path_device_indices(req.last_node)[: job.start].to(torch.int64)
        self.pruned_adopted.add(req.rid)
        indices = torch.cat([path, path.new_full((job.tokens,), PADDING_SLOT)])
        assert len(indices) == req.prefix_len, (req.rid, len(indices), req.prefix_len)
        return indices

    def pruned_job(self, rid: str) -> PrunedRestore | None:
        """The running request's pruned restore (the attention backend asks for every sequence)."""
        return self.pruned.get(rid)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if req.rid in self.pruned:
            self._drop_pruned(req.rid, ran=True)

    def _drop_pruned(self, rid: str, ran: bool) -> None:
        job = self.pruned.pop(rid)
        self.pruned_adopted.discard(rid)
        job.close()  # no read may still write into slots that are about to be reused
        self.token_to_kv_pool_allocator.free(job.slots)  # the page cache is not in the row's freed range
        stats = job.account()
        self.pruned_stats.add(stats)
        self.requests.of(rid).pruned = stats
        for seg in job.bad_segments:
            logger.warning("loopkv: segment %s had damaged extents: removed, that history is recomputed next time", seg)
            self.store.forget_corrupt(seg)
        if not ran:  # a queued request's restore, never run: nothing was used
            return
        mass, touched = job.chunk_importance(), []
        for src in job.sources:  # the value policy learns which chunks the new turn attended to
            rec = self.store.segments.get(src.seg_id)
            if rec is None:
                continue
            vec = None
            if mass is not None:
                vec = torch.zeros(rec.record.n_chunks)
                vec[src.lo : src.hi] = mass[src.first : src.first + src.n_chunks]
            self.store.touch(src.seg_id, rec.record.n_chunks, vec)
            touched.append(src.seg_id)
        self.store.touch_disk(touched)
        self._offering.append(job)  # ranked by values that include this turn's attention
        self.metrics.publish(self.store.count_tokens())
        self.metrics.publish_pruned(self.pruned_stats)

    def _drop_unadopted(self) -> None:
        now = time.monotonic()
        for rid in [
            r for r, j in self.pruned.items() if r not in self.pruned_adopted and now - j.last_used > UNADOPTED_S
        ]:
            self._drop_pruned(rid, ran=False)

    def _store_pruned_turn(self, req, job: PrunedRestore, up_to: int) -> None:
        """Store the finished turn after a pruned history (its KV, computed over the kept chunks, is
        this conversation's from now on) as stored-only nodes below the history: the next turn
        restores it with the rest."""
        start, page = job.start + job.tokens, self.page_size
        end = up_to // page * page
        parent = job.last_node
        if end <= start or _ref(parent) is None or not self._attached(parent):
            return
        tokens = array("q", req.full_untruncated_fill_ids[start:end])  # the tree compares keys of one type
        key = RadixKey(tokens, extra_key=job.key.extra_key, cache_salt=job.key.cache_salt)
        if key.child_key(page) in parent.children:
            return  # another request stored this continuation meanwhile
        node = TreeNode()
        node.parent, node.key = parent, key
        node.value = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].to(torch.int64)
        parent.children[key.child_key(page)] = node
        stored = self._store_node(node, [])
        node.value = None  # stored-only: its slots are the request's row, freed with it
        if not stored:
            del parent.children[key.child_key(page)]

    def _load_back(
        self, stored: list[TreeNode], last_device: TreeNode, req, device_len: int, key_len: int
    ) -> tuple[int, TreeNode]:
        """Fetch the stored nodes' KV (verified), give them device slots, then restore them by the
        restorer's plan: the loader thread copies each layer's back part while this thread
        recomputes each layer's front part."""
        t0 = time.perf_counter()
        # Plan first: a disk read then skips the chunks the plan recomputes.
        job = RestoreJob(
            total=sum(len(nd.key) for nd in stored),
            num_layers=self.geometry.num_layers,
            layer_bytes=self.geometry.token_bytes_per_layer,
            stored_layer_bytes=self.store_geometry.token_bytes_per_layer,
            prefix=device_len,
            new_tokens=max(key_len - device_len - sum(len(nd.key) for nd in stored), 1),
            # a segment read ahead is in RAM already: the plan costs it as a host load
            disk_tokens=sum(
                len(nd.key)
                for nd in stored
                if self.store.tier_of(_ref(nd)[0]) == "disk" and not self.store.read_ahead_done(_ref(nd)[0])
            ),
            chunk=self.page_size,
            overlapped=not self.loader.synchronous,
        )
        plan = self.restorer.plan(job)
        parts: list[tuple[TreeNode, torch.Tensor, str]] = []
        off = 0
        restoring = {_ref(nd)[0] for nd in stored}  # a promotion must not evict the rest of this history
        for node in stored:
            seg, lo, hi = _ref(node)
            skip = [min(max(s - off, 0), len(node.key)) // self.page_size for s in plan.recompute]
            t_fetch = time.perf_counter()
            try:
                kv, tier = self.store.fetch(seg, lo, hi, skip, keep=restoring)
            except CorruptSegment as e:
                logger.warning("loopkv: %s; recomputing that part of the history", e)
                break  # _on_segment_lost already removed the node and its subtree
            finally:
                self.restorer.add_seconds("fetch", time.perf_counter() - t_fetch)
            if tier == "disk":
                self.restorer.observe_disk(*self.store.last_disk_read)
            parts.append((node, kv, tier))
            off += len(node.key)
        # Only nodes still in the tree may get slots: one a tier lost meanwhile was dropped with
        # its subtree, and slots handed out through it would be owned twice once the request
        # inserts its history (and freed under it by eviction).
        for i, (node, _, _) in enumerate(parts):
            if _ref(node) is None or not self._attached(node):
                logger.warning("loopkv: part of a history was lost while it was restored; recomputing it")
                del parts[i:]
                break
        n = sum(len(node.key) for node, _, _ in parts)
        if n == 0:
            return 0, last_device
        if n < job.total:  # a bad segment cut the history short: same plan, clipped (still valid)
            job = replace(job, total=n, disk_tokens=sum(len(nd.key) for nd, _, t in parts if t == "disk"))
            plan = RestorePlan(n, tuple(min(s, n) for s in plan.recompute))
        t_alloc = time.perf_counter()
        slots = self._alloc(n, last_device)
        self.restorer.add_seconds("alloc", time.perf_counter() - t_alloc)
        if slots is None:
            return 0, last_device
        loads, off = [], 0
        for node, kv, tier in parts:
            node.value = slots[off : off + len(node.key)]
            skip = tuple(min(max(s - off, 0), len(node.key)) for s in plan.recompute)
            off += len(node.key)
            self.evictable_size_ += len(node.key)
            self._update_leaf_status(node)
            self._update_leaf_status(node.parent)
            loads.append(LoadPart(kv, node.value, skip))
            tally = self.requests.of(req.rid).loads
            tally[tier] += len(node.key)
            if tier == "disk" and self.store.written_elsewhere(_ref(node)[0]):
                tally["shared"] += len(node.key)
            self.store.stats.hit_tokens[tier] += len(node.key)
        t_submit = time.perf_counter()
        self.loader.submit(loads)
        if self.loader.synchronous:  # the copies ran in submit, before the forward
            self.restorer.add_seconds("loads_first", time.perf_counter() - t_submit)
        elapsed = time.perf_counter() - t0
        self.store.stats.load_seconds += elapsed
        recompute_s = 0.0
        if plan.recompute_tokens:
            recompute_s = self._recompute(plan, job, [nd for nd, _, _ in parts], slots, last_device)
        predicted = self.restorer.record(plan, job)
        by_tier = {t: sum(len(nd.key) for nd, _, tt in parts if tt == t) for t in ("host", "disk")}
        logger.info(
            "loopkv: resuming %d tokens (host %d, disk %d); fetched in %.3f s; plan: recompute %d..%d front tokens "
            "per layer (%.0f%% of token-layers) in %.3f s, the rest %s (predicted bubble %.3f s)",
            n,
            by_tier["host"],
            by_tier["disk"],
            elapsed,
            plan.recompute[0],
            plan.recompute[-1],
            100 * plan.recompute_fraction,
            recompute_s,
            "loaded before the forward" if self.loader.synchronous else "copied layer by layer on the loader thread",
            predicted["bubble_s"],
        )
        return n, parts[-1][0]

    def _recompute(self, plan, job: RestoreJob, nodes: list[TreeNode], slots: torch.Tensor, last_device) -> float:
        """The plan's front part: written straight into the new slots (the loader skips them)."""
        ids = torch.tensor([t for nd in nodes for t in nd.key.raw_token_ids()], dtype=torch.int64)
        k_bufs, v_bufs = self.kv_pool.k_buffer, self.kv_pool.v_buffer
        prefix_slots = None
        if job.prefix:
            path, node = [], last_device
            while node is not self.root_node:
                path.append(node.value)
                node = node.parent
            prefix_slots = torch.cat(path[::-1]).to(torch.int64)

        def write(layer, k, v):
            k_bufs[layer].index_copy_(0, slots[: len(k)], k.to(k_bufs[layer].dtype))
            v_bufs[layer].index_copy_(0, slots[: len(v)], v.to(v_bufs[layer].dtype))

        def prefix_kv(layer):
            return k_bufs[layer][prefix_slots], v_bufs[layer][prefix_slots]

        return self.restorer.recompute(plan, job, ids.to(k_bufs[0].device), write, prefix_kv)

    def _alloc(self, n: int, protect: TreeNode) -> torch.Tensor | None:
        slots = self.token_to_kv_pool_allocator.alloc(n)
        if slots is None:
            self.inc_lock_ref(protect)  # do not evict the prefix we are extending
            try:
                self.evict(EvictParams(num_tokens=n))
            finally:
                self.dec_lock_ref(protect)
            slots = self.token_to_kv_pool_allocator.alloc(n)
        return None if slots is None else slots.to(torch.int64)

    def tier_breakdown(self, rid: str, cached_tokens: int) -> dict[str, int]:
        """Cached tokens of request ``rid`` by the tier they came from (device = already there);
        ``shared``: the part of ``disk`` that another worker process had stored."""
        state = self.requests.get(rid) or RequestState()
        loads = state.loads
        host, disk = min(loads["host"], cached_tokens), min(loads["disk"], max(cached_tokens - loads["host"], 0))
        out = {"device": cached_tokens - host - disk, "host": host, "disk": disk, "shared": min(loads["shared"], disk)}
        job, done = self.pruned.get(rid), state.pruned
        if state.pin is not None:  # a "retain": "pin" request, stored and pinned (or not) before its last token
            out["pin"] = state.pin
        stats = done or (job.account() if job is not None else None)
        if stats is not None:  # a chunk-pruned restore: what it read and used (per request)
            out["pruned"] = {
                "kept_fraction": stats.kept_chunks / stats.scored_chunks if stats.scored_chunks else 1.0,
                "bytes_loaded": stats.bytes_loaded,
                "cached_bytes": stats.cached_bytes,
                "bytes_used": stats.bytes_used,
                "disk_bytes_read": stats.disk_bytes_read,
                "summary_bytes_read": stats.summary_bytes_read,
                "wasted_prefetch_bytes": stats.wasted_prefetch_bytes,
                "io_wait_s": round(stats.io_wait_s, 6),
                "compute_wait_s": round(stats.compute_wait_s, 6),
                "inter_period_overlap": round(stats.inter_period_overlap, 4),
                "decode_selections": stats.decode_selections,
                "recalled_bytes": stats.recalled_bytes,
                "bad_extents": stats.bad_extents,
                "device_tokens": job.cache_tokens if job is not None else stats.cache_tokens,
            }
        return out
