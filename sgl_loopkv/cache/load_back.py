"""Load-back of stored nodes: a match that walked into stored nodes gives them device slots and
restores their KV by the restorer's plan, before the request's extend reads them.

Host (or disk, verified then promoted to host) -> new device slots, layer by layer on the loader
thread (:mod:`sgl_loopkv.cache.loader`), while this thread recomputes each layer's front part. A
corrupt or missing segment ends the restored history there; the rest is recomputed by the extend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_loopkv.cache.loader import LoadPart, beside_forward
from sgl_loopkv.cache.node import ref_of, tokens
from sgl_loopkv.cache.requests import RequestState
from sgl_loopkv.cache.segment_record import CorruptSegment
from sgl_loopkv.restore.plan import RestoreJob, RestorePlan

if TYPE_CHECKING:
    from sgl_loopkv.cache.radix import LoopKVRadixCache

logger = logging.getLogger(__name__)


class LoadBack:
    def __init__(self, tree: LoopKVRadixCache):
        self.tree = tree
        pool = tree.kv_pool
        self.loader = tree.io.make_loader(
            pool.k_buffer,
            pool.v_buffer,
            synchronous=not beside_forward(pool.k_buffer[0].device),
            on_copy=tree.restorer.observe_copy,
            on_wait=tree.restorer.observe_bubble,
        )
        # The pool's get_key_buffer/get_value_buffer wait on it: layer-wise loads overlap the forward
        # under every attention backend.
        pool.register_layer_transfer_counter(self.loader)
        logger.info(
            "loopkv: %s (the KV pool's layer transfer counter)",
            "loads run before the forward" if self.loader.synchronous else "layer-wise loads overlap the forward",
        )

    def count(self, rid: str, seg_id: str, n_tokens: int, tier: str) -> None:
        """``n_tokens`` of ``rid``'s history restored from ``tier``: its per-request tally (``shared``:
        the part of ``disk`` another worker wrote) and the store's hit counters."""
        store = self.tree.store
        tally = self.tree.requests.of(rid).loads
        tally[tier] += n_tokens
        if tier == "disk" and store.written_elsewhere(seg_id):
            tally["shared"] += n_tokens
        store.stats.hit_tokens[tier] += n_tokens

    def tier_breakdown(self, rid: str, cached_tokens: int) -> dict[str, int]:
        """Cached tokens of request ``rid`` by the tier they came from (device = already there), as
        :meth:`count` tallied them; ``shared``: the part of ``disk`` that another worker process had stored."""
        state = self.tree.requests.get(rid) or RequestState()
        loads = state.loads
        host, disk = min(loads["host"], cached_tokens), min(loads["disk"], max(cached_tokens - loads["host"], 0))
        out = {"device": cached_tokens - host - disk, "host": host, "disk": disk, "shared": min(loads["shared"], disk)}
        if state.pin is not None:  # a "retain": "pin" request, stored and pinned (or not) before its last token
            out["pin"] = state.pin
        pruned = self.tree.pruned_admission.report(rid, state)
        if pruned is not None:  # a chunk-pruned restore: what it read and used (per request)
            out["pruned"] = pruned
        return out

    def load(self, stored: list[TreeNode], last_device: TreeNode, req, device_len: int, key_len: int):
        """Fetch the stored nodes' KV (verified), give them device slots, then restore them by the
        restorer's plan: the loader thread copies each layer's back part while this thread
        recomputes each layer's front part. -> (tokens restored, the last node restored)."""
        tree, store, page = self.tree, self.tree.store, self.tree.page_size
        restorer, loader = tree.restorer, tree.loader
        t0 = time.perf_counter()
        # Plan first: a disk read then skips the chunks the plan recomputes.
        job = RestoreJob(
            total=tokens(stored),
            num_layers=tree.geometry.num_layers,
            layer_bytes=tree.geometry.token_bytes_per_layer,
            stored_layer_bytes=tree.store_geometry.token_bytes_per_layer,
            prefix=device_len,
            new_tokens=max(key_len - device_len - tokens(stored), 1),
            # a segment read ahead is in RAM already: the plan costs it as a host load
            disk_tokens=tokens(
                nd
                for nd in stored
                if store.tier_of(ref_of(nd)[0]) == "disk" and not store.read_ahead_done(ref_of(nd)[0])
            ),
            chunk=page,
            overlapped=not loader.synchronous,
        )
        plan = restorer.plan(job)
        parts: list[tuple[TreeNode, torch.Tensor, str]] = []
        off = 0
        restoring = {ref_of(nd)[0] for nd in stored}  # a promotion must not evict the rest of this history
        for node in stored:
            seg, lo, hi = ref_of(node)
            skip = [min(max(s - off, 0), len(node.key)) // page for s in plan.recompute]
            t_fetch = time.perf_counter()
            try:
                kv, tier = store.fetch(seg, lo, hi, skip, keep=restoring)
            except CorruptSegment as e:
                logger.warning("loopkv: %s; recomputing that part of the history", e)
                break  # SegmentNodes.lost already removed the node and its subtree
            finally:
                restorer.add_seconds("fetch", time.perf_counter() - t_fetch)
            if tier == "disk":
                restorer.observe_disk(*store.last_disk_read)
            parts.append((node, kv, tier))
            off += len(node.key)
        # Only nodes still in the tree may get slots: one a tier lost meanwhile was dropped with
        # its subtree, and slots handed out through it would be owned twice once the request
        # inserts its history (and freed under it by eviction).
        for i, (node, _, _) in enumerate(parts):
            if ref_of(node) is None or not tree.seg_nodes.attached(node):
                logger.warning("loopkv: part of a history was lost while it was restored; recomputing it")
                del parts[i:]
                break
        n = tokens(node for node, _, _ in parts)
        if n == 0:
            return 0, last_device
        if n < job.total:  # a bad segment cut the history short: same plan, clipped (still valid)
            job = replace(job, total=n, disk_tokens=tokens(nd for nd, _, t in parts if t == "disk"))
            plan = RestorePlan(n, tuple(min(s, n) for s in plan.recompute))
        t_alloc = time.perf_counter()
        slots = self.alloc(n, last_device)
        restorer.add_seconds("alloc", time.perf_counter() - t_alloc)
        if slots is None:
            return 0, last_device
        loads, off = [], 0
        for node, kv, tier in parts:
            node.value = slots[off : off + len(node.key)]
            skip = tuple(min(max(s - off, 0), len(node.key)) for s in plan.recompute)
            off += len(node.key)
            tree.evictable_size_ += len(node.key)
            tree._update_leaf_status(node)
            tree._update_leaf_status(node.parent)
            loads.append(LoadPart(kv, node.value, skip))
            self.count(req.rid, ref_of(node)[0], len(node.key), tier)
        t_submit = time.perf_counter()
        loader.submit(loads)
        if loader.synchronous:  # the copies ran in submit, before the forward
            restorer.add_seconds("loads_first", time.perf_counter() - t_submit)
        elapsed = time.perf_counter() - t0
        store.stats.load_seconds += elapsed
        recompute_s = 0.0
        if plan.recompute_tokens:
            recompute_s = self._recompute(plan, job, [nd for nd, _, _ in parts], slots, last_device)
        predicted = restorer.record(plan, job)
        by_tier = {t: tokens(nd for nd, _, tt in parts if tt == t) for t in ("host", "disk")}
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
            "loaded before the forward" if loader.synchronous else "copied layer by layer on the loader thread",
            predicted["bubble_s"],
        )
        return n, parts[-1][0]

    def _recompute(self, plan, job: RestoreJob, nodes: list[TreeNode], slots: torch.Tensor, last_device) -> float:
        """The plan's front part: written straight into the new slots (the loader skips them)."""
        tree = self.tree
        ids = torch.tensor([t for nd in nodes for t in nd.key.raw_token_ids()], dtype=torch.int64)
        k_bufs, v_bufs = tree.kv_pool.k_buffer, tree.kv_pool.v_buffer
        prefix_slots = None
        if job.prefix:
            path, node = [], last_device
            while node is not tree.root_node:
                path.append(node.value)
                node = node.parent
            prefix_slots = torch.cat(path[::-1]).to(torch.int64)

        def write(layer, k, v):
            k, v = k.to(k_bufs[layer].dtype), v.to(v_bufs[layer].dtype)
            k_bufs[layer].index_copy_(0, slots[: len(k)], k)
            v_bufs[layer].index_copy_(0, slots[: len(v)], v)
            return k, v

        def prefix_kv(layer):
            return k_bufs[layer][prefix_slots], v_bufs[layer][prefix_slots]

        return tree.restorer.recompute(plan, job, ids.to(k_bufs[0].device), write, prefix_kv)

    def alloc(self, n: int, protect: TreeNode) -> torch.Tensor | None:
        """``n`` device slots, evicting (never ``protect``'s path) if the pool has too few."""
        tree = self.tree
        slots = tree.token_to_kv_pool_allocator.alloc(n)
        if slots is None:
            tree.inc_lock_ref(protect)  # do not evict the prefix we are extending
            try:
                tree.evict(EvictParams(num_tokens=n))
            finally:
                tree.dec_lock_ref(protect)
            slots = tree.token_to_kv_pool_allocator.alloc(n)
        return None if slots is None else slots.to(torch.int64)
