"""Write-through: a finished turn's KV goes to the tiers once its last token is out.

The tree queues the turn at its final ``checkpoint`` under a tree lock (nothing it computed can be
evicted before it is stored); :meth:`WriteThrough.flush` stores it from SGLang's
``flush_pending_backups`` seam, called once the batch's outputs are streamed (the store held the
last token 0.2-0.5 s at 2K new tokens, most with int8 tiers:
docs/decisions/2026-11-26-store-after-the-last-token.md), and by ``evict`` first.
"""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING, NamedTuple

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_loopkv.cache import retention
from sgl_loopkv.cache.address import segment_id
from sgl_loopkv.cache.copy_stream import pinned_host
from sgl_loopkv.cache.layout import key_summaries
from sgl_loopkv.cache.node import StoredNode, ref_of
from sgl_loopkv.cache.segment_record import SegmentRecord
from sgl_loopkv.platform import release_free_heap, torch_single_threaded

if TYPE_CHECKING:
    from sgl_loopkv.cache.pruned import PrunedRestore
    from sgl_loopkv.cache.radix import LoopKVRadixCache

TRIM_EVERY_S = 5.0  # the C heap's free pages go back to the OS at most this often (at a turn's end)
#: the salt prefix --loopkv-lifecycle-require-salt gives requests that bring none (server/salt.py)
UNSALTED = "loopkv-unsalted-"


class Backup(NamedTuple):
    """A finished turn not stored yet."""

    lock: object  # the tree lock on the turn's last node
    pairs: list[tuple[int, int]]  # layer pairs (layer sharing)
    mass: torch.Tensor | None  # chunk attention mass the turn measured
    announced: list[tuple[TreeNode, SegmentRecord]]  # announced on the shared disk at queueing
    hint: retention.Retention
    rid: str | None


class WriteThrough:
    """Stores finished turns' paths as segments; owns the queue of turns waiting for the flush."""

    def __init__(self, tree: LoopKVRadixCache):
        self.tree = tree
        self.backups: list[Backup] = []
        self.offering: list[PrunedRestore] = []  # done restores whose disk reads go to the chunk cache
        self._trimmed_at = 0.0

    def reset(self) -> None:
        self.backups, self.offering = [], []

    def turn_end(self, req) -> None:
        """The request's turn finished (its row is still held): what needs the row (its layer
        pairs, its chunk importance) is taken now, the store waits for :meth:`flush`."""
        tree = self.tree
        pairs = tree.sharing.turn_end(req.kv.req_pool_idx, req.last_node, tree.root_node) if tree.sharing else []
        mass = tree.importance.pop(req.kv.req_pool_idx)
        hint = retention.of_request(req)
        if hint.retain != "none":  # "none": its KV stays in the device tree only (cache.retention)
            self.queue(req.last_node, pairs, mass, hint, req.rid)
        if hint.retain == "pin":  # stored now, before its last token is streamed: the answer says if it pinned
            self.flush()

    def pruned_turn_end(self, req, job: PrunedRestore, up_to: int) -> None:
        """As :meth:`turn_end` for a turn after a chunk-pruned history, stored now (not deferred:
        ``on_release`` frees its page cache)."""
        tree = self.tree
        if retention.of_request(req).retain != "none":  # a pin is not applied on this path (yet)
            self._store_pruned_turn(req, job, up_to)
        tree.importance.pop(req.kv.req_pool_idx)
        tree.metrics.publish(tree.store.count_tokens())

    def queue(self, node: TreeNode, pairs, mass, hint=retention.DEFAULT, rid: str | None = None) -> None:
        """Store the path to ``node`` at the next :meth:`flush`; locked until then. Its segments are
        announced on the shared disk tier now, before the last token goes out: the conversation's
        next turn may reach another worker first, whose lookup then waits for them."""
        tree, announced = self.tree, []  # only announced: the flush derives the records again, since
        # another turn of the same batch may split these nodes before it (their records would change)
        if tree.store.disk is not None:
            for n in self.unstored_path(node):
                record = self.record_of(n)
                tree.store.disk.announce(record)
                announced.append((n, record))
        self.backups.append(Backup(tree.lock(node), pairs, mass, announced, hint, rid))

    def offer(self, job: PrunedRestore) -> None:
        """A finished pruned restore's disk reads go to the host chunk cache at the next flush."""
        self.offering.append(job)

    def flush(self) -> None:
        tree = self.tree
        offering, self.offering = self.offering, []
        backups, self.backups = self.backups, []
        if not (offering or backups):  # most calls (every decode step)
            return
        with torch_single_threaded():  # bulk copies while the next request is being tokenized
            for job in offering:
                job.offer_reads()
            for b in backups:
                try:
                    self.store_path(b.lock.node, b.pairs)
                    self.touch_path(b.lock.node, b.mass)
                    if b.hint.retain == "pin":
                        outcome = retention.pin_outcome(retention.pin_path(tree, b.lock.node, b.hint.ttl_s))
                        tree.requests.of(b.rid).pin = outcome
                finally:
                    tree.unlock(b.lock)
                    for n, record in b.announced:  # not stored under that name: lookups stop waiting for it
                        ref = ref_of(n)
                        if ref is None or ref[0] != record.seg_id:
                            tree.store.disk.unannounce(record)
        if not backups:
            return
        tree.restorer.ensure_calibrated(tree.geometry.token_bytes_per_layer, tree.kv_pool.k_buffer[0].device)
        tree.metrics.publish(tree.store.count_tokens())
        tree.metrics.publish_restore(tree.restorer.stats)  # the bubbles of these turns' forwards
        if time.monotonic() - self._trimmed_at > TRIM_EVERY_S:  # the tiers' freed tensors leave the RSS
            tree.store.buffers.trim()
            release_free_heap()
            self._trimmed_at = time.monotonic()

    def store_path(self, node: TreeNode, pairs: list[tuple[int, int]]) -> None:
        for n in self.unstored_path(node):
            if not self.store_node(n, pairs):
                return

    def unstored_path(self, node: TreeNode) -> list[TreeNode]:
        """The device nodes above ``node`` (itself included) not stored yet, root first (a segment's
        parent must be stored before it)."""
        path, root = [], self.tree.root_node
        while node is not root and ref_of(node) is None and not node.evicted:
            path.append(node)
            node = node.parent
        return path[::-1]

    def touch_path(self, node: TreeNode, mass: torch.Tensor | None) -> None:
        """A turn used its whole history: one access for every stored segment on the path, weighted
        by the chunk attention mass the turn measured (uniform when none was measured)."""
        tree, store, path = self.tree, self.tree.store, []
        while node is not tree.root_node:
            path.append(node)
            node = node.parent
        if mass is not None and float(mass.sum()) > 0:
            mass = mass * (len(mass) / float(mass.sum()))  # mean 1 per chunk over the attended history
        per_segment: dict[str, torch.Tensor | None] = {}
        pos = 0
        for n in reversed(path):
            ref = ref_of(n)
            if ref is not None:
                seg, lo, hi = ref
                rec = store.segments.get(seg)
                if rec is not None:
                    if mass is None:
                        per_segment.setdefault(seg, None)
                    else:
                        vec = per_segment.get(seg)
                        vec = torch.zeros(rec.record.n_chunks) if vec is None else vec
                        part = mass[pos // tree.page_size : (pos + len(n.key)) // tree.page_size]
                        vec[lo : lo + len(part)] += part
                        per_segment[seg] = vec
            pos += len(n.key)
        for seg, vec in per_segment.items():
            store.touch(seg, store.segments[seg].record.n_chunks, vec if vec is not None and vec.sum() > 0 else None)
        store.touch_disk(per_segment)  # the shared tier's LRU: whole path at once, any worker sees it

    def store_node(self, node: TreeNode, pairs: list[tuple[int, int]]) -> bool:
        tree = self.tree
        if (node.key.cache_salt or "").startswith(UNSALTED):
            return False  # --loopkv-lifecycle-require-salt: a request of its own namespace, which nothing could resume
        parent_ref = ref_of(node.parent) if node.parent is not tree.root_node else None
        if node.parent is not tree.root_node and parent_ref is None:
            return False  # its prefix is not stored: it could never be matched from the tiers
        kv = self.gather(node.value)
        record = self.record_of(node)
        codec = tree.sharing.codec if pairs else None
        if not tree.store.put(record, kv, key_summaries(kv[:, 0], tree.page_size), pairs, codec):
            return False
        tree.store.stats.shared_segments += bool(pairs)
        tree.seg_nodes.set_ref(node, (record.seg_id, 0, record.n_chunks))
        return True

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The pool's KV of ``slots`` as [L, 2, T, H, D] on the host, gathered straight into one
        buffer (a stack of per-layer gathers copied every byte twice: a 2K-token turn's store took
        ~60 ms on the scheduler thread, a third of it the second copy). Where only its int8 form is
        kept (a quantized tier), the buffer is the tier store's reused memory: fresh pages would be
        faulted in on the scheduler thread, turn after turn (:mod:`~sgl_loopkv.cache.read_buffers`)."""
        tree = self.tree
        pool, layers = tree.kv_pool, tree.geometry.num_layers
        k0 = pool.k_buffer[0]
        on_host = k0.device.type == "cpu"
        shape = (layers, 2, len(slots), *k0.shape[1:])
        if on_host and tree.store.geometry.quantized:
            out = tree.store.buffers.empty(shape, k0.dtype)
        else:
            out = torch.empty(shape, dtype=k0.dtype, pin_memory=pinned_host(k0.device))
        for layer in range(layers):
            for i, buf in enumerate((pool.k_buffer[layer], pool.v_buffer[layer])):
                if on_host:
                    torch.index_select(buf, 0, slots, out=out[layer, i])
                else:
                    out[layer, i].copy_(buf[slots])
        return out

    def record_of(self, node: TreeNode) -> SegmentRecord:
        """The segment ``node`` is stored as: named by its whole history's chain hash."""
        tree, keys, up = self.tree, [], node
        while up is not tree.root_node:
            keys.append(up.key)
            up = up.parent
        history = [t for k in reversed(keys) for t in k.raw_token_ids()]  # from the root to the end of node
        n_chunks = len(node.key) // tree.page_size
        start = sum(len(k) for k in keys[1:])  # where node's key starts in the history
        chain = tree.chain(history, node.key)
        first = start // tree.page_size
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

    def _store_pruned_turn(self, req, job: PrunedRestore, up_to: int) -> None:
        """Store the finished turn after a pruned history (its KV, computed over the kept chunks, is
        this conversation's from now on) as stored-only nodes below the history: the next turn
        restores it with the rest."""
        tree = self.tree
        start, page = job.start + job.tokens, tree.page_size
        end = up_to // page * page
        parent = job.last_node
        if end <= start or ref_of(parent) is None or not tree.seg_nodes.attached(parent):
            return
        tokens = array("q", req.full_untruncated_fill_ids[start:end])  # the tree compares keys of one type
        key = RadixKey(tokens, extra_key=job.key.extra_key, cache_salt=job.key.cache_salt)
        if key.child_key(page) in parent.children:
            return  # another request stored this continuation meanwhile
        slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].to(torch.int64)
        node = StoredNode()
        node.parent, node.key, node.value = parent, key, slots
        parent.children[key.child_key(page)] = node
        stored = self.store_node(node, [])
        node.value = None  # stored-only: its slots are the request's row, freed with it
        if not stored:
            del parent.children[key.child_key(page)]
