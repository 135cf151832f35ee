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

By ``cache_salt`` alone: every stored chunk of that salt. The removal from the tiers is
:mod:`sgl_loopkv.cache.forget_tiers`; then the worker leaves a note (hashes only) in the shared
directory so that the other workers drop their own device and host copies (:class:`ForgetNotes`).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

from sgl_loopkv.cache.address import chunk_chain
from sgl_loopkv.cache.forget_tiers import Busy, ForgetReport, Holdings, holdings, remove

logger = logging.getLogger(__name__)

NOTES = "forgotten"  # the disk tier's subdirectory of notes to the other workers
NOTE_KEEP_S = 24 * 3600.0  # a note older than this is removed (a worker down that long restarts empty)


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
