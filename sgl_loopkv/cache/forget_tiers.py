"""A forget's work on the tiers (:mod:`sgl_loopkv.cache.forget` decides what goes): what the device
tree, the host arena and the disk directory hold, as chunk hashes (:func:`holdings`), and removing
chunks from them (:func:`remove`): the tree's nodes are split at the first removed chunk and their
subtrees freed; a segment whose chunks are all removed is deleted; one that straddles the kept prefix
is written again holding the kept chunks only (files are immutable: the old file, which holds the
removed token ids in its header, goes).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sgl_loopkv.cache.address import chunk_chain, segment_id
from sgl_loopkv.cache.disk_dir import SEG_PREFIX, SEG_SUFFIX
from sgl_loopkv.cache.disk_evict import NoRoom, fsync_dir
from sgl_loopkv.cache.packed import kv_nbytes, slice_tokens
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentRecord

logger = logging.getLogger(__name__)


class Busy(Exception):
    """A request that is running now uses part of what is to be forgotten (its KV is locked)."""


@dataclass(slots=True)
class TierCount:
    segments: int = 0
    tokens: int = 0
    bytes: int = 0


@dataclass(slots=True)
class ForgetReport:
    """What one forget removed, per tier (``device``: tokens of the device tree's KV pool)."""

    device: TierCount = field(default_factory=TierCount)
    host: TierCount = field(default_factory=TierCount)
    disk: TierCount = field(default_factory=TierCount)
    kept_shared_tokens: int = 0  # the prefix other stored histories continue from: kept
    rewritten_segments: int = 0  # segments that held the kept prefix too: stored again without the rest
    removed_chunks: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Holdings:
    """What the tiers hold, as chunk hashes: ``succ[h]`` the chunks stored right after chunk ``h``
    (a history's first chunk follows ``("root", extra_key, salt)``), ``salt[h]`` its cache salt."""

    succ: dict = field(default_factory=lambda: defaultdict(set))
    salt: dict = field(default_factory=dict)
    node_hashes: dict = field(default_factory=dict)  # tree node -> its chunks' hashes
    headers: dict = field(default_factory=dict)  # seg_id -> verified header of every segment file

    def add(self, pred, hashes: list[str], salt: str | None) -> None:
        for h in hashes:
            self.succ[pred].add(h)
            self.salt[h] = salt
            pred = h


def holdings(cache, with_disk: bool = True) -> Holdings:
    """Every chunk the tree, the host arena and (``with_disk``) the disk directory hold."""
    out, page = Holdings(), cache.page_size
    stack = [(child, None) for child in cache.root_node.children.values()]
    while stack:
        node, prev = stack.pop()
        key = node.key
        root = cache.namespace_root(key.extra_key, key.cache_salt) if prev is None else bytes.fromhex(prev)
        hashes = chunk_chain(key.raw_token_ids(), page, root)
        out.node_hashes[node] = hashes
        out.add(prev or ("root", key.extra_key, key.cache_salt), hashes, key.cache_salt)
        stack.extend((child, hashes[-1] if hashes else prev) for child in node.children.values())
    for seg in cache.store.segments.values():
        r = seg.record
        out.add(r.parent or ("root", r.extra_key, r.cache_salt), r.chunk_hashes, r.cache_salt)
    disk = cache.store.disk
    if with_disk and disk is not None:
        for f in disk.root.glob(f"{SEG_PREFIX}*{SEG_SUFFIX}"):
            seg_id = f.name[len(SEG_PREFIX) : -len(SEG_SUFFIX)]
            try:
                header = disk.read_header(seg_id)
            except (CorruptSegment, ValueError) as e:  # damaged or gone meanwhile: nothing to read it by
                logger.warning("loopkv: forget skips %s: %s", f.name, e)
                continue
            header["file_bytes"] = f.stat().st_size if f.exists() else 0
            out.headers[seg_id] = header
            pred = header.get("parent") or ("root", header.get("extra_key"), header.get("cache_salt"))
            out.add(pred, header.get("chunk_hashes") or [], header.get("cache_salt"))
    return out


def remove(cache, removed: set[str], held: Holdings) -> ForgetReport:
    """Remove the chunks ``removed`` from this worker's tree and host arena and from the disk tier.
    Raises :class:`Busy` (before changing anything) when a running request holds part of them."""
    report, page, store = ForgetReport(removed_chunks=len(removed)), cache.page_size, cache.store
    targets = []
    for node, hashes in held.node_hashes.items():
        i = next((k for k, h in enumerate(hashes) if h in removed), None)
        parent_hit = node.parent is not cache.root_node and any(
            h in removed for h in held.node_hashes.get(node.parent, ())
        )
        if i is not None and not parent_hit:
            targets.append((node, i))
    segs = {sid: s.record for sid, s in store.segments.items() if any(h in removed for h in s.record.chunk_hashes)}
    files = {sid: h for sid, h in held.headers.items() if any(x in removed for x in h.get("chunk_hashes") or [])}
    busy = [n for n, _ in targets if n.lock_ref > 0]
    busy += [
        rid
        for rid, job in cache.pruned.items()
        if rid in cache.pruned_admission.adopted and {s.seg_id for s in job.sources} & set(segs)
    ]
    if busy:
        raise Busy(f"{len(busy)} running request(s) use this conversation's KV; retry when they finish")
    for rid in [r for r, j in cache.pruned.items() if {s.seg_id for s in j.sources} & set(segs)]:
        cache.pruned_admission.drop(rid, ran=False)
    for node, i in targets:
        if i > 0:
            cache._split_node(node.key, node, i * page)  # node keeps chunks [i, ...) below a new upper node
        report.device.tokens += _free_subtree(cache, node)
    for seg_id in sorted(set(segs) | set(files)):
        _remove_segment(cache, seg_id, segs.get(seg_id), files.get(seg_id), removed, report)
    store.flush()  # the kept prefixes written again are on disk before the answer
    if store.disk is not None:
        fsync_dir(store.disk.root)
        fsync_dir(store.disk.root / "chunks")
    cache.metrics.publish(store.count_tokens())
    return report


def _free_subtree(cache, top) -> int:
    """Free ``top`` and everything below it (device slots, stored references); -> device tokens freed."""
    order, stack = [], [top]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    freed = 0
    for node in reversed(order):  # leaves first
        if not node.evicted:
            cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            cache.evictable_size_ -= len(node.key)
            freed += len(node.key)
            node.value = None
        cache.evictable_leaves.discard(node)
        cache.seg_nodes.set_ref(node, None)
    parent = top.parent
    if parent.children.get(top.key.child_key(cache.page_size)) is top:
        del parent.children[top.key.child_key(cache.page_size)]
    cache._update_leaf_status(parent)
    return freed


def _remove_segment(cache, seg_id: str, record, header: dict | None, removed: set[str], report: ForgetReport):
    """Delete a segment holding removed chunks from the host arena and the disk; its leading chunks
    that are kept (a shared prefix) are stored again under their own name first."""
    store, page = cache.store, cache.page_size
    hashes = record.chunk_hashes if record is not None else header["chunk_hashes"]
    keep = next(k for k, h in enumerate(hashes) if h in removed)
    seg = store.segments.get(seg_id)
    n_tokens = (len(hashes) - keep) * page
    kept = _read_kept(store, seg, seg_id, keep) if keep else None
    if seg is not None and seg.in_host:
        report.host.segments += 1
        report.host.tokens += n_tokens
        report.host.bytes += store._host_bytes(seg)
    if header is not None or (seg is not None and seg.on_disk):
        report.disk.segments += 1
        report.disk.tokens += n_tokens
        path = store.disk.path(seg_id)
        report.disk.bytes += path.stat().st_size if path.exists() else 0
    new = None
    if kept is not None:
        base = record or _record_of_header(header)
        new = SegmentRecord(
            seg_id=segment_id(base.start // page, hashes[keep - 1]),
            parent=base.parent,
            start=base.start,
            n_chunks=keep,
            file_bytes=0,
            extra_key=base.extra_key,
            cache_salt=base.cache_salt,
            token_ids=list(base.token_ids[: keep * page]),
            chunk_hashes=list(hashes[:keep]),
        )
        for node in list(cache.seg_nodes.of(seg_id)):
            _, lo, hi = node.lkv
            if hi <= keep:
                cache.seg_nodes.set_ref(node, (new.seg_id, lo, hi))
    if seg is not None:
        store.remove(seg_id)
    elif store.disk is not None:
        store.disk.delete(seg_id)
    if kept is None:
        return
    kv, summaries = kept
    report.rewritten_segments += 1
    if seg is not None or cache.seg_nodes.of(new.seg_id):
        if not store.put(new, kv, summaries):
            cache.seg_nodes.lost(new.seg_id)
        elif seg is not None and seg.in_host:
            report.host.bytes -= kv_nbytes(kv) + summaries.numel() * summaries.element_size()
        return
    try:
        store.disk.write(new, kv, summaries)
    except (NoRoom, OSError) as e:  # the shared prefix is recomputed by whoever needs it next
        logger.warning("loopkv: the kept prefix of segment %s was not stored again: %s", seg_id, e)


def _read_kept(store, seg, seg_id: str, keep: int):
    """(KV, summaries) of a segment's first ``keep`` chunks, from the host arena or the disk; None if unreadable."""
    c = store.geometry.chunk_tokens
    if seg is not None and seg.in_host:
        return slice_tokens(seg.host_kv, 0, keep * c), seg.host_summaries[:, :keep].clone()
    try:
        return store.disk.read(seg_id, 0, keep), store.disk.read_summaries(seg_id)[:, :keep].clone()
    except CorruptSegment as e:
        logger.warning("loopkv: the kept prefix of %s is not readable (%s): recomputed when needed", seg_id, e)
        return None


def _record_of_header(h: dict) -> SegmentRecord:
    return SegmentRecord(
        seg_id=h["seg_id"],
        parent=h.get("parent"),
        start=h["start"],
        n_chunks=h["n_chunks"],
        file_bytes=0,
        extra_key=h.get("extra_key"),
        cache_salt=h.get("cache_salt"),
        token_ids=h["token_ids"],
        chunk_hashes=h.get("chunk_hashes") or [],
    )
