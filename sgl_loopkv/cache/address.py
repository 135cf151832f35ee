"""Content addresses of stored KV: a hash chain over a history's chunks.

The disk tier is shared by every worker of a cluster, so a stored segment must be findable from
the tokens alone, whoever stored it and however it cut the history into segments::

    root   = H(format version, KV geometry, extra_key, cache_salt)       (the namespace)
    h[j]   = H(h[j - 1], token ids of chunk j)                            (h[-1] = root)

``h[j]`` names chunk ``j`` *of this exact history* (every earlier token and the namespace are in
it), so two workers that store the same history produce the same names, and a worker that knows a
prompt's tokens computes, without asking anyone, the name under which chunk ``j`` would be stored.
The model itself is not hashed here: the tier's directory is already one per model (its weights,
config and geometry; ``cache.backend.model_fingerprint``).

A segment covering chunks ``[s, e)`` is named by ``(s, h[e - 1])``: the same history cut the same
way by two workers is one file. Segment boundaries still differ between workers (one stores
``[0, 4)`` and ``[4, 8)``, another ``[0, 8)``), which is why lookups go by chunk, not by segment
(:mod:`sgl_loopkv.cache.disk`: one name per stored chunk, a hard link to its segment file).
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16  # 128-bit names: collisions are out of reach for any cache size


def namespace(format_version: int, geometry: dict, extra_key: str | None, cache_salt: str | None) -> bytes:
    """The chain's root: KV stored under another format, geometry, LoRA/extra key or salt never matches."""
    ident = json.dumps([format_version, geometry, extra_key, cache_salt], sort_keys=True)
    return hashlib.blake2b(ident.encode(), digest_size=DIGEST_BYTES).digest()


def chunk_chain(token_ids: Sequence[int], chunk_tokens: int, root: bytes, n_chunks: int | None = None) -> list[str]:
    """``h[j]`` (hex) for the first ``n_chunks`` whole chunks of ``token_ids`` (all whole chunks by
    default): about a microsecond per chunk."""
    n = len(token_ids) // chunk_tokens if n_chunks is None else n_chunks
    if n * chunk_tokens > len(token_ids):
        raise ValueError(f"{n} chunks of {chunk_tokens} tokens need {n * chunk_tokens} ids, got {len(token_ids)}")
    ids = array("q", token_ids[: n * chunk_tokens])
    if sys.byteorder == "big":  # the same names on every machine of a cluster
        ids.byteswap()
    raw, step = ids.tobytes(), 8 * chunk_tokens
    out, prev = [], root
    for j in range(n):
        prev = hashlib.blake2b(prev + raw[j * step : (j + 1) * step], digest_size=DIGEST_BYTES).digest()
        out.append(prev.hex())
    return out


def segment_id(start_chunk: int, last_chunk_hash: str) -> str:
    """The file name stem of a segment of chunks ``[start_chunk, ...]`` ending at the chunk whose
    chain hash is ``last_chunk_hash``: the start is in the name so that eviction can prefer the deep
    end of a history without opening files."""
    return f"{start_chunk:06d}-{last_chunk_hash}"


def start_of(seg_id: str) -> int:
    """The first chunk of a segment, read from its id (0 for ids that carry none)."""
    head = seg_id.split("-", 1)[0]
    return int(head) if head.isdigit() and "-" in seg_id else 0
