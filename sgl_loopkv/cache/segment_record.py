"""What the disk tier stores and how it fails: one segment's record, the file format's version,
and the errors a read raises. Shared by the tiers and the tree; the bytes of a file:
:mod:`sgl_loopkv.cache.segment_file`."""

from __future__ import annotations

from dataclasses import dataclass, field

LAYER_GROUP = 4  # rows per group when the writer names none (the default prefix gate)

# 4: grouped extents (rows in groups of "layer_group", a chunk's extents of a group adjacent).
#    Format 3 files are never found by a format 4 worker (the version is part of every name,
#    cache.address) and age out under the quota.
# 3: content-addressed names, per-chunk links, no index (shared by several workers).
# 2: extents padded to 512-byte sectors, float16 summaries next to narrower tiers, int8 tiers.
FORMAT_VERSION = 4


class CorruptSegment(Exception):
    """A stored segment is missing, truncated or fails its checksum."""


class SegmentGone(CorruptSegment):
    """A stored segment's file is no longer there (evicted by some worker): not damage."""


@dataclass(slots=True)
class SegmentRecord:
    """One stored segment. ``start`` is the position of its first token in the conversation;
    ``parent`` the chain hash of the chunk just before it (None at position 0); ``chunk_hashes`` the
    chain hash of each of its chunks (none: the segment gets no chunk links, so it is found only by
    its id); ``writer`` the process that stored it (``host:pid``)."""

    seg_id: str
    parent: str | None
    start: int
    n_chunks: int
    file_bytes: int
    extra_key: str | None = None  # SGLang's RadixKey namespace (LoRA id, ...)
    cache_salt: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    chunk_hashes: list[str] = field(default_factory=list, repr=False)
    writer: str = ""
