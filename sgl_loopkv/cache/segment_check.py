"""Verifying a segment file's parts: its header (read, checksummed or decrypted, checked against
the tier's format and geometry) and each unit after it (an extent, a summary layer, the side data),
by its crc32 or, in a sealed file, by its AES-GCM tag (:mod:`sgl_loopkv.cache.cipher`)."""

from __future__ import annotations

import base64
import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from sgl_loopkv.cache.cipher import MAGIC_SEALED, TAG_BYTES, SegmentCipher
from sgl_loopkv.cache.layout import MAGIC, PREAMBLE_BYTES, KVGeometry, SegmentFileLayout, align_up
from sgl_loopkv.cache.segment_record import FORMAT_VERSION, CorruptSegment

try:  # the same CRC-32 (zlib's polynomial, same values), folded with PCLMUL: 19 MB 0.7 ms vs 4.7 ms
    from zlib_ng.zlib_ng import crc32
except ImportError:  # requirements/cpu.txt installs it; without it, zlib's
    from zlib import crc32

__all__ = ["SegmentCheck", "crc32"]


@dataclass(frozen=True, slots=True)
class SegmentCheck:
    """Checks the parts of segment files of one KV geometry; with a ``cipher`` only sealed files
    pass (a unit's tag takes the place of its crc32), without one only plain files."""

    geometry: KVGeometry
    cipher: SegmentCipher | None = None

    def header(self, fd: int, seg_id: str) -> dict:
        """The verified header of an open segment file (``kv_offset`` added; a sealed file's salt and
        tags decoded as ``_salt``, ``_tags``)."""
        magic = MAGIC if self.cipher is None else MAGIC_SEALED
        try:
            pre = os.pread(fd, PREAMBLE_BYTES, 0)
            if len(pre) != PREAMBLE_BYTES or pre[:8] != magic:
                sealed = "sealed" if pre[:8] == MAGIC_SEALED else "plain" if pre[:8] == MAGIC else "unknown"
                raise CorruptSegment(
                    f"segment {seg_id}: bad preamble (a {sealed} file, this tier reads only "
                    f"{'plain' if self.cipher is None else 'sealed'} ones)"
                )
            hlen, hcrc = struct.unpack("<II", pre[8:])
            hbytes = os.pread(fd, hlen, PREAMBLE_BYTES)
        except OSError as e:
            raise CorruptSegment(f"segment {seg_id}: {e}") from e
        if len(hbytes) != hlen or crc32(hbytes) != hcrc:
            raise CorruptSegment(f"segment {seg_id}: header checksum mismatch")
        plain = hbytes if self.cipher is None else self.cipher.open_header(hbytes)
        if plain is None:
            raise CorruptSegment(f"segment {seg_id}: header does not decrypt with this key (another key, or tampered)")
        try:
            header = json.loads(plain)
            if self.cipher is not None:
                header["_salt"], header["_tags"] = bytes.fromhex(header["salt"]), base64.b64decode(header["tags"])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptSegment(f"segment {seg_id}: unreadable header ({type(e).__name__})") from e
        if (
            not isinstance(header, dict)
            or header.get("format") != FORMAT_VERSION
            or header.get("geometry") != self.geometry.to_json()
        ):
            raise CorruptSegment(f"segment {seg_id}: another format or KV geometry")
        if self.cipher is not None and not seg_id.startswith("chunk ") and header.get("seg_id") != seg_id:
            # a whole sealed file copied over another name: intact under the key, but another history's KV
            raise CorruptSegment(f"segment {seg_id}: its sealed header names another segment")
        header["kv_offset"] = align_up(PREAMBLE_BYTES + hlen)
        return header

    def layout(self, header: dict) -> SegmentFileLayout:
        """Where each part of the file whose verified header this is lies."""
        return SegmentFileLayout(
            self.geometry,
            header["n_chunks"],
            header["kv_offset"],
            header.get("rows"),
            header.get("side_bytes", 0),
            header["layer_group"],
        )

    def open_extents(self, header: dict, k0: int, src: memoryview, dst: memoryview, got: int, n: int) -> np.ndarray:
        """Decrypt the first ``got`` of ``n`` sealed extents (units ``k0 ...``) from ``src`` into ``dst``
        -> ok [n]. One staging buffer for ciphertext | tag (AES-GCM wants them adjacent; the tags are in
        the header): a new one per extent cost as much as the decryption."""
        eb, tags, sid, salt = self.geometry.extent_bytes, header["_tags"], header["seg_id"], header["_salt"]
        sealed = bytearray(eb + TAG_BYTES)
        staged, open_into, ok = memoryview(sealed), self.cipher.open_into, np.zeros(n, bool)
        for i in range(got):
            staged[:eb] = src[i * eb : (i + 1) * eb]
            staged[eb:] = tags[(k0 + i) * TAG_BYTES : (k0 + i + 1) * TAG_BYTES]
            ok[i] = open_into(sid, salt, k0 + i, sealed, dst[i * eb : (i + 1) * eb])
        return ok

    def unit_ok(self, header: dict, unit: int, data, crc: int | None, out=None) -> bool:
        """Is unit ``unit`` (``data``, its stored bytes) intact? Plain: its crc32 is ``crc``. Sealed:
        it decrypts under its tag, into ``out`` (a writable buffer of its length)."""
        if self.cipher is None:
            return crc32(data) == crc
        sealed = bytearray(len(data) + TAG_BYTES)
        sealed[: len(data)] = data
        sealed[len(data) :] = header["_tags"][unit * TAG_BYTES : (unit + 1) * TAG_BYTES]
        return self.cipher.open_into(header["seg_id"], header["_salt"], unit, sealed, out)
