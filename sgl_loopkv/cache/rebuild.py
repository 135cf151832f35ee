"""Start-up: re-create the radix tree's stored nodes from the disk index, so conversations resume
after a restart (parents before children; a segment whose prefix did not survive is dropped)."""

from __future__ import annotations

import logging
from array import array
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_loopkv.cache.disk import CorruptSegment, SegmentRecord

if TYPE_CHECKING:
    from sgl_loopkv.cache.radix import LoopKVRadixCache

logger = logging.getLogger(__name__)


def rebuild_from_store(cache: LoopKVRadixCache) -> int:
    """Insert a node without a device copy for every readable disk segment; returns how many."""
    store = cache.store
    if store.disk is None:
        return 0
    tokens: dict[str, list[int]] = {}
    records = sorted(store.disk.records.values(), key=lambda r: r.start)
    restored = 0
    for rec in records:
        try:
            header = store.disk.read_header(rec.seg_id)
        except CorruptSegment as e:
            logger.warning("loopkv: dropping stored segment: %s", e)
            store.drop(rec.seg_id)
            continue
        prefix = tokens.get(rec.parent, [])[: rec.start] if rec.parent else []
        if len(prefix) != rec.start:  # its parent did not survive
            store.drop(rec.seg_id)  # its prefix is gone: unreachable
            continue
        tokens[rec.seg_id] = prefix + header["token_ids"]
        if _insert_stored(cache, tokens[rec.seg_id], rec):
            restored += 1
        else:
            store.drop(rec.seg_id)
    if restored:
        logger.info("loopkv: restored %d stored segments from %s", restored, store.disk.root)
    return restored


def _insert_stored(cache: LoopKVRadixCache, full_tokens: list[int], rec: SegmentRecord) -> bool:
    page = cache.page_size
    key = RadixKey(array("q", full_tokens), rec.extra_key, cache_salt=rec.cache_salt)
    node, pos = cache.root_node, 0
    while pos < rec.start:  # the prefix must already be in the tree
        child = node.children.get(key[pos:].child_key(page))
        if child is None:
            return False
        plen = child.key.match(key[pos:], page_size=page)
        if plen < len(child.key):
            if pos + plen < rec.start:
                return False
            child = cache._split_node(child.key, child, plen)
        node, pos = child, pos + len(child.key)
    if pos != rec.start:
        return False
    rest = key[rec.start :]
    if rest.child_key(page) in node.children:
        return False  # this history is already in the tree
    new = TreeNode()
    new.parent, new.key, new.value = node, rest, None
    node.children[rest.child_key(page)] = new
    cache.set_ref(new, (rec.seg_id, 0, rec.n_chunks))
    return True
