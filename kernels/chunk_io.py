"""Disk reads straight into their destinations (``chunk_io.cpp``), built by
:mod:`sgl_loopkv.kernels.native`: a chunk-pruned restore's extents into KV pool pages, a whole
segment's into the rows tensors it becomes (no buffer in file order copied again).

Why native: a restore's reader thread shares the GIL with the forward. Read in Python, each extent
took a ``preadv`` into a buffer, a ``crc32`` call and a share of a copy into its pool page, every
one a GIL hand-off, and the forward's Python waited for them (``docs/decisions/2026-11-28-native-chunk-reads.md``).
:func:`load` returns the compiled module (``read_extents(fd, blocks, targets, crcs, sizes,
extent_bytes) -> (ok, bytes, preadv seconds, crc32 seconds)``, run without the GIL) or None: callers
then read in Python
(``LOOPKV_NATIVE_CHUNK_IO=0`` turns it off).
"""

from __future__ import annotations

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("chunk_io", "LOOPKV_NATIVE_CHUNK_IO", "chunk reads")


def load(verbose: bool = False):
    """The compiled extension with its crc32 chosen, or None when it cannot be had here."""
    module = EXTENSION.load(verbose)
    if module is not None and not module.available():
        _choose_crc32(module)
    return module if module is not None and module.available() else None


def _choose_crc32(module) -> None:
    """zlib-ng's crc32 from the Python module that wraps it (PCLMUL), else the system zlib's: the
    same CRC-32 the files were written with (:mod:`sgl_loopkv.cache.segment_file`)."""
    try:
        import zlib_ng.zlib_ng as ng

        if module.use_crc32(ng.__file__, "zng_crc32", False):
            return
    except ImportError:
        pass
    module.use_crc32("libz.so.1", "crc32", True)
