"""Chunk-pruned restores inside the tree (ContiguousKV, :mod:`sgl_loopkv.cache.pruned`): a long
stored history is not loaded whole; the match admits a :class:`PrunedRestore` that reads the chunks
each period keeps into a small page cache during the new turn's prefill.

Lifecycle of a restore, by request id::

    match_prefix ── admit ──> jobs[rid]            (slots held outside the tree; a waiting request
         │                                          matched again gets the same restore)
    maybe_hand_to_session ──> adopted              (its row now points at the padding slot)
    on_release ── drop(ran=True) ──> stats, value-policy touches, reads offered to the chunk cache
    never run for UNADOPTED_S ── drop(ran=False)   (aborted while queued: slots back)
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_loopkv.cache.node import ref_of, tokens
from sgl_loopkv.cache.pruned import (
    KVBuffers,
    PrunedHistory,
    PrunedParams,
    PrunedRestore,
    PrunedStats,
    Source,
)
from sgl_loopkv.cache.segment_record import CorruptSegment

if TYPE_CHECKING:
    from sgl_loopkv.cache.radix import LoopKVRadixCache
    from sgl_loopkv.cache.requests import RequestState

logger = logging.getLogger(__name__)

# A pruned restore made for a waiting request that never ran (aborted while queued) gives its slots
# back after this long without being matched again (a waiting request is re-matched every round).
UNADOPTED_S = 30.0
PADDING_SLOT = 0  # SGLang's allocators never hand out the pool's first page: dummy writes land there


class PrunedAdmission:
    def __init__(self, tree: LoopKVRadixCache):
        self.tree = tree
        self.jobs: OrderedDict[str, PrunedRestore] = OrderedDict()  # rid -> its chunk-pruned restore
        # rids whose row holds their restore's slots. Not a field of the request's RequestState: a
        # restore owns device slots, which must not age out of a bounded map with the request's record.
        self.adopted: set[str] = set()
        self.stats = PrunedStats()  # every finished pruned restore, summed
        self.reader = tree.io.make_chunk_reader()
        if self.cfg.enabled and tree.store.disk is not None:
            from sgl_loopkv.kernels import chunk_io

            chunk_io.load()  # built (first start on a machine) or loaded now, not at a restore's first read

    @property
    def cfg(self):
        return self.tree.prefix  # --loopkv-prefix-* (PrefixConfig)

    def prunes(self, stored: list[TreeNode]) -> bool:
        """Whether this history is restored chunk by chunk: pruning (or streaming) is on, the loopkv
        attention backend runs (it executes the kept-chunk plans) and the history is long enough."""
        if not self.cfg.enabled or self.tree.restorer.stack is None:
            return False
        return tokens(stored) >= self.cfg.min_tokens

    def admit(self, stored: list[TreeNode], last_device: TreeNode, req, device_len: int, key) -> PrunedRestore | None:
        """Slots for the stored history and a :class:`PrunedRestore` that fills them during the new
        turn's prefill. A waiting request matched again gets the restore it already has."""
        tree, store, cfg, page = self.tree, self.tree.store, self.cfg, self.tree.page_size
        total = tokens(stored)
        t0 = time.perf_counter()
        job = self.jobs.get(req.rid)
        if job is not None:
            if job.start == device_len and job.tokens == total and req.rid not in self.adopted:
                job.last_used = time.monotonic()
                return job
            self.drop(req.rid, ran=req.rid in self.adopted)
        # Restores of requests still queued hold their slots outside the tree (nothing can evict
        # them): the first always, then up to half of the pool; past that a history loads the
        # tree's way, whose slots the scheduler can take back, so queued restores cannot starve
        # the requests that run.
        held = sum(j.cache_tokens for r, j in self.jobs.items() if r not in self.adopted)
        if held and held + self.cache_chunks(total // page) * page > tree.kv_pool.size // 2:
            logger.info("loopkv: %d tokens of queued pruned restores: this history loads whole", held)
            return None
        sources, restoring, first = [], {ref_of(nd)[0] for nd in stored}, 0
        summaries, admission_read = [], store.stats.disk_bytes_read
        # chunks are scored at each period's first layer only, and not at all when every chunk is kept
        scored = (
            list(range(0, tree.geometry.num_layers, cfg.period)) if cfg.budget < 1 and cfg.selection == "chunks" else []
        )
        try:
            for node in stored:
                seg, lo, hi = ref_of(node)
                try:
                    host_kv, fd, header, summ, tier = store.chunk_source(
                        seg, lo, hi, scored, restoring, cache_summaries=self.caches_chunks()
                    )
                except CorruptSegment as e:
                    logger.warning("loopkv: %s; recomputing that part of the history", e)
                    break  # the node and its subtree went with the segment
                cache = store.chunk_cache if fd is not None and self.caches_chunks() else None
                sources.append(Source(seg, lo, hi, first, host_kv, fd, header, cache))
                summaries.append(summ)
                first += hi - lo
                tree.load_back.count(req.rid, seg, len(node.key), tier)
            n = first * page
            if n == 0 or any(ref_of(nd) is None or not tree.seg_nodes.attached(nd) for nd in stored[: len(sources)]):
                raise LookupError("part of the history was lost while it was restored")
            slots = tree.load_back.alloc(self.cache_chunks(first) * page, last_device)  # the page cache
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
            KVBuffers(tree.kv_pool.k_buffer, tree.kv_pool.v_buffer),
            self.reader,
            PrunedParams.from_config(cfg, page),
            disk=store.disk,
        )
        job.attach(slots)
        admitted = store.stats.disk_bytes_read - admission_read  # the scored layers' key summaries
        job.stats.summary_bytes_read = admitted
        job.stats.disk_bytes_read += admitted
        job.last_node = stored[len(sources) - 1]
        job.key = key
        self.jobs[req.rid] = job
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

    def caches_chunks(self) -> bool:
        """Whether disk chunks a restore reads are offered to the host chunk cache: under a budget, with
        chunk selection (the IMPRESS-style baseline reads whole layers for its probe: not a working set)."""
        cfg = self.cfg
        return cfg.budget < 1 and cfg.selection == "chunks" and cfg.host_cache

    def cache_chunks(self, n_chunks: int) -> int:
        return PrunedRestore.capacity_for(n_chunks, self.cfg.budget, self.cfg.selection)

    def row_prefix(self, path: torch.Tensor, job: PrunedRestore) -> torch.Tensor:
        """The request's row prefix: the device path before the history, then the pruned history's
        positions, which hold no KV of their own: they point at the pool's padding slot (the
        allocator never hands out page 0), and the loopkv backend's plans read the restore's page
        cache for them instead."""
        path = path[: job.start].to(torch.int64)
        return torch.cat([path, path.new_full((job.tokens,), PADDING_SLOT)])

    def adopt(self, rid: str) -> None:
        """``rid``'s row was written with :meth:`row_prefix`: its restore runs with the request now."""
        if rid in self.jobs:
            self.adopted.add(rid)

    def release(self, rid: str) -> None:
        if rid in self.jobs:
            self.drop(rid, ran=True)

    def drop(self, rid: str, ran: bool) -> None:
        """End ``rid``'s restore: its page cache goes back to the pool and its accounting to the totals;
        if it ran, the value policy learns which chunks the new turn attended to."""
        tree, store = self.tree, self.tree.store
        job = self.jobs.pop(rid)
        self.adopted.discard(rid)
        job.close()  # no read may still write into slots that are about to be reused
        tree.token_to_kv_pool_allocator.free(job.slots)  # the page cache is not in the row's freed range
        stats = job.account()
        self.stats.add(stats)
        tree.requests.of(rid).pruned = stats
        for seg in job.bad_segments:
            logger.warning("loopkv: segment %s had damaged extents: removed, that history is recomputed next time", seg)
            store.forget_corrupt(seg)
        if not ran:  # a queued request's restore, never run: nothing was used
            return
        self.stats.restores += 1
        mass, touched = job.chunk_importance(), []
        for src in job.sources:
            rec = store.segments.get(src.seg_id)
            if rec is None:
                continue
            vec = None
            if mass is not None:
                vec = torch.zeros(rec.record.n_chunks)
                vec[src.lo : src.hi] = mass[src.first : src.first + src.n_chunks]
            store.touch(src.seg_id, rec.record.n_chunks, vec)
            touched.append(src.seg_id)
        store.touch_disk(touched)
        tree.write_through.offer(job)  # ranked by values that include this turn's attention
        tree.metrics.publish(store.count_tokens())
        tree.metrics.publish_pruned(self.stats)

    def drop_unadopted(self) -> None:
        now = time.monotonic()
        for rid in [r for r, j in self.jobs.items() if r not in self.adopted and now - j.last_used > UNADOPTED_S]:
            self.drop(rid, ran=False)

    def report(self, rid: str, state: RequestState) -> dict | None:
        """What ``rid``'s chunk-pruned restore read and used (running or finished), or None."""
        job, stats = self.jobs.get(rid), state.pruned
        stats = stats or (job.account() if job is not None else None)
        if stats is None:
            return None
        return {
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
