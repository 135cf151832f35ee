"""The names of the disk tier's files: a segment's path from its id, a chunk link's (and its
announcement's) from the chunk's chain hash, each checked so that no name leaves the directory.
What the names mean: :mod:`sgl_loopkv.cache.disk`."""

from __future__ import annotations

import re
from pathlib import Path

from sgl_loopkv.cache.disk_dir import SEG_PREFIX, SEG_SUFFIX

CHUNKS = "chunks"  # the folder of chunk links
# Segment ids are minted by the cache (address.segment_id), never taken from a request; path()
# refuses anything else, and so does a header naming another id, so no path can leave the directory.
SEG_ID = re.compile(r"[0-9A-Za-z_-]{1,80}")
CHUNK_HASH = re.compile(r"[0-9a-f]{32}")


class DiskNames:
    """Paths in the tier's directory ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def segment(self, seg_id: str) -> Path:
        if not SEG_ID.fullmatch(seg_id):
            raise ValueError(f"not a segment id: {seg_id!r}")
        return self.root / f"{SEG_PREFIX}{seg_id}{SEG_SUFFIX}"

    def chunk(self, chunk_hash: str, suffix: str = "") -> Path:
        if not CHUNK_HASH.fullmatch(chunk_hash):
            raise ValueError(f"not a chunk hash: {chunk_hash!r}")
        return self.root / CHUNKS / (chunk_hash + suffix)
