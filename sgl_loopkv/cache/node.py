"""A tree node's stored extent: which chunks of which segment hold its KV in the host/disk tiers."""

from __future__ import annotations

from typing import NamedTuple

from sglang.srt.mem_cache.radix_cache import TreeNode


class SegmentRef(NamedTuple):
    seg_id: str
    lo: int  # first chunk of the segment this node holds
    hi: int  # end chunk (exclusive)


class StoredNode(TreeNode):
    """A node this package creates (found on the shared disk, or a turn stored after a pruned
    history). SGLang creates the tree's other nodes (insert, split) as its own ``TreeNode`` and has
    no factory hook for them: :meth:`LoopKVRadixCache.set_ref` gives those the same field."""

    lkv: SegmentRef | None = None


def ref_of(node: TreeNode) -> SegmentRef | None:
    """The node's stored extent, or None when its KV is on the device only."""
    return getattr(node, "lkv", None)


def tokens(nodes) -> int:
    """Tokens held by ``nodes`` (their keys' lengths)."""
    return sum(len(nd.key) for nd in nodes)
