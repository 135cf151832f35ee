"""The CPU paged-decode kernel (``paged_decode.cpp``), built by :mod:`sgl_loopkv.kernels.native`.

Why a kernel: in torch alone a decode step over a fragmented pool either loops over slot runs
(two small matmuls per run) or gathers the whole prefix first (a second copy of the KV per layer).
The kernel reads each key and value row in place, once, for every sequence of the batch in one call.

:func:`load` returns the compiled module or None (then callers keep the torch paths;
``LOOPKV_NATIVE_DECODE=0`` turns it off). ``python -m sgl_loopkv.kernels.paged_decode`` builds every
native kernel ahead of the server (``install.sh`` does).
"""

from __future__ import annotations

import logging

from sgl_loopkv.kernels.native import NativeExtension

EXTENSION = NativeExtension("paged_decode", "LOOPKV_NATIVE_DECODE", "paged decode")


def load(verbose: bool = False):
    """The compiled extension (``.paged_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale,
    out, min_split)``), or None when it cannot be had here."""
    return EXTENSION.load(verbose)


def build_dir():
    return EXTENSION.build_dir()


if __name__ == "__main__":
    from sgl_loopkv.kernels.native import all_extensions

    logging.basicConfig(level=logging.INFO)
    ok = True
    for ext in all_extensions():
        module = ext.load(verbose=True)
        ok &= module is not None
        print(f"{ext.stem}: {'built' if module is not None else 'NOT available'} in {ext.build_dir()}")
    raise SystemExit(0 if ok else 1)
