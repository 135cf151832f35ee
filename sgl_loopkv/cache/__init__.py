"""Tiered conversation KV: radix-tree nodes whose KV lives on the device, in a host arena and on
disk, in 16-token chunks (see ``layout.py`` for the on-disk format, ``radix.py`` for the SGLang
glue)."""
