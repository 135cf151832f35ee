"""Per-conversation cross-layer sharing at turn end (Krul): which layer pairs of the turn's new
history segments are stored as one row.

The attention statistics of a conversation add up over its turns: the radix node that ends a turn
keeps the sum so far (``node.krul_stats``), and the next turn adds its own rows to the nearest
such ancestor's. The stats live in memory only: after a restart a conversation's next turn starts
a new sum (its stored segments keep the pairs they were written with).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sgl_loopkv.krul.observer import KrulObserver

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import TreeNode

logger = logging.getLogger(__name__)


class LayerSharing:
    def __init__(self, codec: str, gamma: float, ratio: float, pairing: str, observer: KrulObserver):
        self.codec, self.gamma, self.ratio, self.pairing = codec, gamma, ratio, pairing
        self.observer = observer  # the attention's statistics board (sgl_loopkv.context)
        self.last_pairs: list[tuple[int, int]] = []

    def turn_end(self, req_row: int, last_node: TreeNode, root: TreeNode) -> list[tuple[int, int]]:
        """Pairs for the segments this turn stores (empty: store every layer)."""
        from sgl_loopkv.krul.pairing import select_pairs

        stats = self.observer.pop(req_row)
        node = last_node
        while node is not root and getattr(node, "krul_stats", None) is None:
            node = node.parent
        prev = None if node is root else node.krul_stats
        total = stats if prev is None else (prev if stats is None else prev + stats)
        if total is None:
            return []
        last_node.krul_stats = total
        self.last_pairs = [tuple(p) for p in select_pairs(total, self.gamma, self.ratio, self.pairing)]
        if self.last_pairs:
            logger.info(
                "loopkv: turn stored with %d shared layer pairs (%s): %s",
                len(self.last_pairs),
                self.codec,
                self.last_pairs,
            )
        return self.last_pairs
