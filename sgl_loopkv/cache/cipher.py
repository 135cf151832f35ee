"""Encryption at rest of segment files (``--loopkv-lifecycle-disk-key-file``): AES-256-GCM from ``cryptography``.

A sealed file keeps the plain layout (:mod:`sgl_loopkv.cache.layout`), so chunk-aligned reads stay
chunk-aligned: every *unit* is sealed on its own and its ciphertext fills the unit's place byte for
byte; the 16-byte tags go into the header, which is sealed too::

    preamble   MAGIC_SEALED | u32 len | u32 crc32(sealed header)      (the crc only catches torn writes)
    header     nonce[12] | AES-GCM(JSON header, aad=MAGIC_SEALED) | tag[16]
    unit k     AES-GCM(plain bytes, nonce = salt[8] | u32 k, aad = seg_id | k), tag k in the header

Units, numbered in this order: each extent (file order), each layer's summary block, the side data.
``salt`` is 8 random bytes per segment (in the header), so a nonce repeats only if two segments
draw the same salt: ~2^32 segments under one key. The aad binds a unit to its segment and place: a
unit moved to another offset or file fails its tag, as a wrong key or a flipped byte does, and the
reader treats it like a failed crc32 (the history is recomputed).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC_SEALED = b"LOOPKVE1"  # a plain reader stops at the preamble (and a sealed one at a plain file's)
KEY_BYTES = 32
TAG_BYTES = 16
SALT_BYTES = 8


class KeyFileError(ValueError):
    """``--loopkv-lifecycle-disk-key-file`` names no usable key: stops the server at start-up."""


def load_key(path: str | Path) -> bytes:
    """The 32-byte key in ``path``: 32 raw bytes, or 64 hex digits (one trailing newline allowed).
    Refuses a file that others than its owner may read. The key itself never appears in an error."""
    p = Path(path).expanduser()
    flag = "--loopkv-lifecycle-disk-key-file"
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{flag} {p}: not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"{flag} {p}: readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"make it private: chmod 600 {p}"
            )
        raw = p.read_bytes()
    except KeyFileError:
        raise
    except OSError as e:
        raise KeyFileError(f"{flag} {p}: cannot read the key file ({e.strerror or e})") from None
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise KeyFileError(
        f"{flag} {p}: holds {len(raw)} bytes; a key is {KEY_BYTES} raw bytes or {2 * KEY_BYTES} hex digits "
        f"(make one: python -c 'import os; print(os.urandom({KEY_BYTES}).hex())' > {p}; chmod 600 {p})"
    )


class SegmentCipher:
    """Seals and opens the header and units of segment files under one key (see the module doc).
    Holds the key only for its AES-GCM object and this process's native reader (:meth:`opener_key`):
    neither ``repr`` nor any message shows it."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise KeyFileError(f"an AES-256 key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)
        self._key = bytes(key)
        # Names the key without revealing it (a one-way hash): the disk tier's directory carries it, so
        # segments under another key are never looked up (cache.backend)
        self.key_id = hashlib.sha256(b"sgl-loopkv disk key id\0" + key).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"SegmentCipher(key_id={self.key_id})"

    @classmethod
    def from_file(cls, path: str | Path) -> SegmentCipher:
        return cls(load_key(path))

    def opener_key(self) -> bytes:
        """The raw key, for the native whole-segment reader in this process (``kernels/sealed_io.cpp``),
        which opens units with the same AES-256-GCM; never written or logged."""
        return self._key

    # --- header ------------------------------------------------------------------------------
    def seal_header(self, plain: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, plain, MAGIC_SEALED)

    def open_header(self, sealed: bytes) -> bytes | None:
        """The header's JSON bytes; None when this key cannot open it (another key, or tampered)."""
        if len(sealed) < 12 + TAG_BYTES:
            return None
        try:
            return self._aead.decrypt(sealed[:12], sealed[12:], MAGIC_SEALED)
        except InvalidTag:
            return None

    # --- units -------------------------------------------------------------------------------
    @staticmethod
    def new_salt() -> bytes:
        return os.urandom(SALT_BYTES)

    @staticmethod
    def _nonce_aad(seg_id: str, salt: bytes, unit: int) -> tuple[bytes, bytes]:
        k = struct.pack(">I", unit)
        return salt + k, seg_id.encode() + b"\0" + k

    def seal(self, seg_id: str, salt: bytes, unit: int, plain) -> tuple[bytes, bytes]:
        """(ciphertext, the same length as ``plain``; its tag) of unit ``unit``."""
        nonce, aad = self._nonce_aad(seg_id, salt, unit)
        out = self._aead.encrypt(nonce, plain, aad)
        return out[:-TAG_BYTES], out[-TAG_BYTES:]

    def seal_into(self, seg_id: str, salt: bytes, unit: int, plain, out: bytearray) -> None:
        """Encrypt unit ``unit`` into ``out`` (``len(plain) + TAG_BYTES``: the ciphertext, then its tag)."""
        nonce, aad = self._nonce_aad(seg_id, salt, unit)
        self._aead.encrypt_into(nonce, plain, aad, out)

    def open_into(self, seg_id: str, salt: bytes, unit: int, sealed: bytearray, out) -> bool:
        """Decrypt unit ``unit`` into ``out`` (a writable buffer of the plain length); ``sealed`` is
        its ciphertext followed by its tag. -> False when the tag fails (``out`` is then garbage)."""
        nonce, aad = self._nonce_aad(seg_id, salt, unit)
        try:
            self._aead.decrypt_into(nonce, sealed, aad, out)
        except InvalidTag:
            return False
        return True
