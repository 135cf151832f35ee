"""Whole reads of sealed (encrypted) segment files straight into their rows (``sealed_io.cpp``), built
by :mod:`sgl_loopkv.kernels.native`.

Why native: opened in Python, every extent (a 16-token chunk of one layer, a few KB) took a staging
copy, a nonce and an ``AESGCM.decrypt_into`` call, then the whole read was copied again from file
order into the rows' layout; on a reader thread that shares the GIL with the scheduler, an encrypted
4K-token resume from disk took ~1.25x the plain one (``docs/decisions/2026-12-07-sealed-reads-native.md``).
Here a piece of the file is read into the reading thread's buffer (kept between calls) and each extent
is opened with the process's libcrypto (found at run time, no OpenSSL headers needed), its pieces
decrypted straight to their targets, all without the GIL. :func:`load` returns the module
(``read_sealed(fd, blocks, units, tags, targets, sizes, extent_bytes, key, salt, seg_id) -> (ok, bytes,
pread seconds, open seconds)``) or
None: callers then read in Python (``LOOPKV_NATIVE_SEALED_IO=0`` turns it off).
"""

from __future__ import annotations

import ctypes.util

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("sealed_io", "LOOPKV_NATIVE_SEALED_IO", "sealed segment reads")
#: dlopen names tried in order: OpenSSL 3's, then whatever the system's linker calls libcrypto.
LIBCRYPTO = ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so")


def load(verbose: bool = False):
    """The compiled extension with a libcrypto found, or None when it cannot be had here."""
    module = EXTENSION.load(verbose)
    if module is not None and not module.available():
        names = (*LIBCRYPTO, ctypes.util.find_library("crypto") or "")
        any(name and module.use_libcrypto(name) for name in names)
    return module if module is not None and module.available() else None
