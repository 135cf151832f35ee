"""A tree node's stored extent: which chunks of which segment hold its KV in the host/disk tiers,
and the index from a segment back to its nodes (:class:`SegmentNodes`)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, NamedTuple

from sglang.srt.mem_cache.radix_cache import TreeNode

if TYPE_CHECKING:
    from sgl_loopkv.cache.radix import LoopKVRadixCache


class SegmentRef(NamedTuple):
    seg_id: str
    lo: int  # first chunk of the segment this node holds
    hi: int  # end chunk (exclusive)


class StoredNode(TreeNode):
    """A node this package creates (found on the shared disk, or a turn stored after a pruned
    history). SGLang creates the tree's other nodes (insert, split) as its own ``TreeNode`` and has
    no factory hook for them: :meth:`SegmentNodes.set_ref` gives those the same field."""

    lkv: SegmentRef | None = None


def ref_of(node: TreeNode) -> SegmentRef | None:
    """The node's stored extent, or None when its KV is on the device only."""
    return getattr(node, "lkv", None)


def tokens(nodes) -> int:
    """Tokens held by ``nodes`` (their keys' lengths)."""
    return sum(len(nd.key) for nd in nodes)


class SegmentNodes:
    """seg_id -> the tree's nodes whose stored extent lies in that segment (a split node's parts
    share one), so that a segment the tiers lose takes its nodes' extents with it (:meth:`lost`)."""

    def __init__(self, tree: LoopKVRadixCache):
        self.tree = tree
        self._nodes: dict[str, set[TreeNode]] = defaultdict(set)

    def set_ref(self, node: TreeNode, ref: tuple[str, int, int] | None) -> None:
        """Give ``node`` the stored extent ``ref`` (seg_id, lo, hi), or none."""
        self.discard(node)
        node.lkv = None if ref is None else SegmentRef(*ref)
        if ref is not None:
            self._nodes[ref[0]].add(node)

    def of(self, seg_id: str) -> set[TreeNode]:
        return self._nodes.get(seg_id, set())

    def discard(self, node: TreeNode) -> None:
        """Unlist ``node`` (its ``lkv`` stays as it is)."""
        ref = ref_of(node)
        if ref is not None:
            self._nodes[ref[0]].discard(node)

    def clear(self) -> None:
        self._nodes.clear()

    def lost(self, seg_id: str) -> None:
        """No tier holds ``seg_id`` any more: its nodes lose their extents, and one without a device
        copy leaves the tree with its subtree."""
        for node in list(self._nodes.pop(seg_id, ())):
            node.lkv = None
            if node.evicted:
                self.drop_subtree(node)

    def drop_subtree(self, node: TreeNode) -> None:
        """Remove an evicted node whose KV is gone, with everything below it (unreachable now)."""
        for child in list(node.children.values()):
            self.drop_subtree(child)
        self.discard(node)
        page, parent = self.tree.page_size, node.parent
        if parent is not None and parent.children.get(node.key.child_key(page)) is node:
            del parent.children[node.key.child_key(page)]
            self.tree._update_leaf_status(parent)

    def attached(self, node: TreeNode) -> bool:
        """Whether ``node`` is still reachable from the root (a dropped subtree keeps its parent links)."""
        page = self.tree.page_size
        while node is not self.tree.root_node:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(page)) is not node:
                return False
            node = parent
        return True
