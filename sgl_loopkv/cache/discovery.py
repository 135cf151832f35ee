"""Cross-worker discovery on the shared disk tier, and the hold-backs it decides.

The disk tier is shared by every worker of a cluster and content-addressed
(:mod:`sgl_loopkv.cache.address`). When the tree has no more of a prompt, the match asks the disk for
the next chunk by its chain hash and hangs what it finds (another worker's turns, or this worker's
before a restart) into the tree as stored nodes. A request is held back (not admitted this round)
while its history goes on in a segment another worker announced and has not published yet, or while
its disk-only segments are read ahead on the prefetch thread (:mod:`sgl_loopkv.cache.prefetch`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_loopkv.cache.disk import Found
from sgl_loopkv.cache.disk_announce import Announced
from sgl_loopkv.cache.node import StoredNode, ref_of, tokens

if TYPE_CHECKING:
    from sgl_loopkv.cache.radix import LoopKVRadixCache

logger = logging.getLogger(__name__)

# A waiting request is matched again at every scheduling round: its shared-disk lookup (a hash chain
# over the prompt, an open per segment) is redone at most this often for the same position.
RELOOK_S = 1.0
# A request whose history is read ahead from disk (cache/prefetch.py) is held back at most this long,
# then reads inline like before (a read slower than this is a disk in trouble, not a queue).
READ_AHEAD_WAIT_S = 30.0
READ_AHEAD = "<disk read ahead>"  # what RequestState.awaiting names (announced chunks: their hash)


class SharedDiskDiscovery:
    def __init__(self, tree: LoopKVRadixCache):
        self.tree = tree

    def discover(self, key: RadixKey, node: TreeNode, pos: int, rid: str) -> list[TreeNode]:
        """Stored runs of ``key`` after position ``pos`` (where the tree's match ended, at ``node``)
        that the shared disk holds: found chunk by chunk (one ``open`` per stored segment), hung
        below ``node`` as stored nodes. Returns them, root first."""
        tree = self.tree
        page = tree.page_size
        if pos >= len(key) or key[pos:].child_key(page) in node.children:
            return []  # the tree knows this continuation (its copy is gone): not looked up again
        now, n = time.monotonic(), len(key) // page
        state = tree.requests.of(rid)
        last = state.lookup
        if last is not None and last[0] == n and last[2] == pos and now - last[3] < RELOOK_S:
            return []  # the same request, still waiting: nothing found here a moment ago
        chain = last[1] if last is not None and last[0] == n else tree.chain(key.raw_token_ids(), key)
        found_nodes = []
        while pos < len(key):
            found = tree.store.disk.probe(chain, pos // page)
            if isinstance(found, Announced) and self._await(rid, chain[pos // page], found, now):
                state.lookup = (n, chain, pos, -math.inf)  # looked up again next round
                break
            self.stop_awaiting(rid)
            if not isinstance(found, Found):
                state.lookup = (n, chain, pos, now)
                break
            n = (found.hi - found.lo) * page
            tree.store.register(found.record)
            new = StoredNode()
            new.parent, new.key, new.value = node, key[pos : pos + n], None
            node.children[new.key.child_key(page)] = new
            tree.seg_nodes.set_ref(new, (found.record.seg_id, found.lo, found.hi))
            found_nodes.append(new)
            node, pos = new, pos + n
        if found_nodes:
            logger.info("loopkv: found %d stored tokens on the shared disk tier", tokens(found_nodes))
        return found_nodes

    def _await(self, rid: str, chunk_hash: str, announced: Announced, now: float) -> bool:
        """The lookup of ``rid`` ended at a chunk another worker announced: whether to hold the
        request back for it (its budget counted from when this request first saw that announcement)."""
        state = self.tree.requests.of(rid)
        prev = state.awaiting
        until = prev[1] if prev is not None and prev[0] == chunk_hash else now + announced.wait_s
        state.awaiting = (chunk_hash, until, now < until)
        return now < until

    def reads_ahead(self, stored: list[TreeNode], rid: str) -> bool:
        """Whether ``rid`` sits this round out while its disk-only segments are read on the prefetch
        thread (:mod:`sgl_loopkv.cache.prefetch`), not inside this match on the scheduler thread.
        Never past ``READ_AHEAD_WAIT_S`` from its first wait: then it reads inline, as before."""
        store = self.tree.store
        if not any([store.read_ahead(ref_of(nd)[0]) for nd in stored]):  # every read started, not just the first
            return False
        state = self.tree.requests.of(rid)
        now, prev = time.monotonic(), state.awaiting
        if prev is None or prev[0] != READ_AHEAD:
            logger.info(
                "loopkv: reading %d stored tokens from disk ahead of their request (held in the queue meanwhile)",
                tokens(nd for nd in stored if store.tier_of(ref_of(nd)[0]) == "disk"),
            )
        until = prev[1] if prev is not None and prev[0] == READ_AHEAD else now + READ_AHEAD_WAIT_S
        state.awaiting = (READ_AHEAD, until, now < until)
        return now < until

    def stop_awaiting(self, rid: str) -> None:
        state = self.tree.requests.get(rid)
        if state is not None and state.awaiting is not None and state.awaiting[2]:
            state.awaiting = (*state.awaiting[:2], False)

    def admitted(self, rid: str) -> None:
        """``rid`` loads its history now: if it sat out rounds while its disk read ran on the prefetch
        thread, that wait is counted and ended."""
        state = self.tree.requests.get(rid)
        if state is not None and state.awaiting is not None and state.awaiting[0] == READ_AHEAD:
            self.tree.restorer.add_seconds("held", time.monotonic() - (state.awaiting[1] - READ_AHEAD_WAIT_S))
            state.awaiting = None

    def awaits_write(self, req) -> bool:
        """Whether the scheduler should hold ``req`` back this round: its history goes on in a
        segment that another worker announced and has not published yet, and waiting for it is
        still worth it (the announcement's budget, :meth:`DiskSegmentStore.probe`). A request seen
        for the first time, or one held back, is looked up here as its next match would (SGLang's
        ``init_next_round_input``): the hook that calls this runs before the scheduler matches and
        admits requests (:mod:`sgl_loopkv.cache.awaited`)."""
        tree = self.tree
        if tree.disable or tree.store.disk is None:
            return False
        rid = req.rid
        state = tree.requests.of(rid)
        if state.probed and (state.awaiting is None or not state.awaiting[2]):
            return False
        state.probed = True
        self.stop_awaiting(rid)  # the lookup below says it again if it still ends at an announcement
        state.probing = True  # a disk-only history is read ahead while the request waits, not in the match
        try:
            req.init_next_round_input(tree)
        finally:
            state.probing = False
        return state.awaiting is not None and state.awaiting[2]
