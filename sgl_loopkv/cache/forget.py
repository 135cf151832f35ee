"""Forgetting a conversation: its stored KV removed from every tier (device tree, host arena, the
shared disk tier), on the scheduler thread of the worker that is asked (:mod:`sgl_loopkv.server.forget`).

Everything is reasoned about by chain hash (:mod:`sgl_loopkv.cache.address`): a hash names one
chunk of one exact history, whichever tier or worker holds it. The tiers' holdings form a graph
of chunk -> next chunk edges (tree nodes, host segments, every segment file's header). For a
history ``P`` with chain ``c[0..n)`` and a *private start* ``S`` (the first chunk that belongs to
this conversation alone: the first chunk of its first non-system message for chat messages, the
last whole chunk for a raw prompt)::

    removed = every stored chunk whose history agrees with P through chunk S  (the conversation:
              all its turns, answers, regenerated branches)
            + c[S-1], c[S-2], ... while no other stored history continues from that chunk
    kept    = c[0..K): the first chunk that another history continues from ends the walk (a system
              prompt that other conversations share; the response reports it)

By ``cache_salt`` alone: every stored chunk of that salt. Removal (:func:`remove`): the tree's
nodes are split at the first removed chunk and their subtrees freed; a segment whose chunks are all
removed is deleted; one that straddles the kept prefix is written again holding the kept chunks only
(files are immutable: the old file, which holds the removed token ids in its header, goes). Then
the worker leaves a note (hashes only) in the shared directory so that the other workers drop their
own device and host copies (:class:`ForgetNotes`).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sgl_loopkv.cache.address import chunk_chain, segment_id
from sgl_loopkv.cache.disk_dir import SEG_PREFIX, SEG_SUFFIX
from sgl_loopkv.cache.disk_evict import NoRoom, fsync_dir
from sgl_loopkv.cache.packed import kv_nbytes, slice_tokens
from sgl_loopkv.cache.segment_record import CorruptSegment, SegmentRecord

logger = logging.getLogger(__name__)

NOTES = "forgotten"  # the disk tier's subdirectory of notes to the other workers
NOTE_KEEP_S = 24 * 3600.0  # a note older than this is removed (a worker down that long restarts empty)


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


def forget(
    cache, token_ids: list[int] | None = None, private_start: int | None = None, extra_key=None, salt=None
) -> ForgetReport | None:
    """Forget the history ``token_ids`` (its own tokens from ``private_start`` on; default: its last
    whole chunk) in the namespace of ``extra_key`` and ``salt``, or with no ids everything of ``salt``.
    -> what was removed, None when nothing stored matches. Raises :class:`Busy`, ``ValueError``."""
    page = cache.page_size
    _settle(cache)
    held = holdings(cache)
    kept = 0
    if token_ids is not None:
        chain = chunk_chain(token_ids, page, cache.namespace_root(extra_key, salt))
        if not chain:
            raise ValueError(f"{len(token_ids)} tokens are less than one chunk ({page}): nothing of them is stored")
        start = len(chain) - 1 if private_start is None else private_start // page
        removed, kept = conversation(chain, start, held)
        kept = kept if kept and chain[kept - 1] in held.salt else 0
    elif salt:
        removed = of_salt(salt, held)
    else:
        raise ValueError("nothing to forget: give token ids or a cache_salt")
    if not removed:
        return None
    report = remove(cache, removed, held)
    report.kept_shared_tokens = kept * page
    cache.store.stats.forgets += 1
    cache.metrics.publish(cache.store.count_tokens())
    notes = _notes(cache)
    if notes is not None:
        notes.write(removed)
    logger.info(
        "loopkv: forgot %d chunks (device %d tokens, host %d segments, disk %d segments; %d shared tokens kept)",
        len(removed),
        report.device.tokens,
        report.host.segments,
        report.disk.segments,
        report.kept_shared_tokens,
    )
    return report


def apply_notes(cache) -> None:
    """Apply the other workers' forgets to this worker's tree and host arena (called at each match;
    one ``listdir``). A note that a running request blocks is applied later."""
    notes = _notes(cache)
    if notes is None:
        return
    todo = notes.pending()
    if not todo:
        return
    _settle(cache)
    held = holdings(cache, with_disk=False)
    for name, hashes in todo:
        mine = hashes & held.salt.keys()
        try:
            if mine:
                remove(cache, mine, held)
                held = holdings(cache, with_disk=False)
        except Busy:  # tried again at a later match
            continue
        notes.applied.add(name)


def _notes(cache) -> ForgetNotes | None:
    disk = cache.store.disk
    if disk is None:
        return None
    notes = getattr(cache, "forget_notes", None)
    if notes is None:
        notes = cache.forget_notes = ForgetNotes(disk.root)
    return notes


def _settle(cache) -> None:
    """Nothing in flight: finished turns stored, queued disk writes done, loads finished, the disk
    writers' evictions applied."""
    cache.flush_pending_backups()
    cache.store.flush()
    cache.loader.wait_all()
    cache.store.sync()


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


def conversation(chain: list[str], private_start: int, held: Holdings) -> tuple[set[str], int]:
    """(the chunk hashes to remove, K: the length in chunks of the kept shared prefix) for the
    history ``chain`` whose chunks from ``private_start`` on are its own (see the module doc)."""
    removed: set[str] = set()
    s = min(private_start, len(chain) - 1)
    frontier = [chain[s]] if chain[s] in held.salt else []
    while frontier:
        h = frontier.pop()
        if h not in removed:
            removed.add(h)
            frontier.extend(held.succ.get(h, ()))
    j = s - 1
    while j >= 0 and not held.succ.get(chain[j], set()) - removed:
        removed.add(chain[j])
        j -= 1
    return {h for h in removed if h in held.salt}, j + 1


def of_salt(salt: str, held: Holdings) -> set[str]:
    return {h for h, s in held.salt.items() if s == salt}


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


class ForgetNotes:
    """Forgets told to the other workers of a shared disk tier: ``forgotten/<ns>-<rand>.json``, the
    removed chunks' hashes (never token ids). Each worker applies every note it has not applied yet to
    its own tree and host arena (the disk is done by the forgetting worker), looking for new notes at
    every match (before the tree walk); a note a running request blocks stays pending."""

    def __init__(self, root: Path):
        self.dir = root / NOTES
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.applied: set[str] = set()
        self.prune()

    def write(self, removed: set[str]) -> None:
        name = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}.json"
        tmp = self.dir / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w") as f:
            json.dump({"hashes": sorted(removed)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.dir / name)
        self.applied.add(name)  # done here already

    def pending(self) -> list[tuple[str, set[str]]]:
        """Notes not applied yet, oldest first (one ``listdir`` of a small folder). By name, not by the
        folder's mtime: a note's temporary file and its rename can share one mtime tick."""
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(".json") and n not in self.applied)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            try:
                out.append((name, set(json.loads((self.dir / name).read_text())["hashes"])))
            except (OSError, ValueError, KeyError):
                continue
        return out

    def prune(self) -> None:
        for f in self.dir.glob("*.json"):
            try:
                if time.time() - f.stat().st_mtime > NOTE_KEEP_S:
                    f.unlink()
            except FileNotFoundError:
                continue
