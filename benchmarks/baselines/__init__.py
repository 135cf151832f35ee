"""Baselines the benchmarks measure sgl-loopkv's mechanisms against, kept out of the package: each
registers into one of the package's registries when imported (in a server's processes, by naming
it in ``LOOPKV_EXTENSIONS``: :mod:`sgl_loopkv.extensions`)."""
