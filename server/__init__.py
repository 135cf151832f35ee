"""Serving entry points (importable as ``sgl_loopkv.server``)."""
