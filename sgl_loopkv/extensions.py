"""Modules outside the package that register components into its registries (a benchmark's
baseline, e.g. ``benchmarks.baselines.impress``): named, comma-separated, by the environment
variable ``LOOPKV_EXTENSIONS``, which a server's processes inherit. They are imported where
registered names are read: by the plugin in every SGLang process (:func:`sgl_loopkv.plugin.register`)
and before a flag lists its registry's names (:meth:`sgl_loopkv.flags.Option.choices`, the launcher's
parser), so ``--loopkv-prefix-selection impress`` is accepted only where the baseline is loaded."""

from __future__ import annotations

import importlib
import os

ENV = "LOOPKV_EXTENSIONS"

_loaded: set[str] = set()


def names() -> list[str]:
    return [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]


def load_extensions() -> None:
    """Import every module ``LOOPKV_EXTENSIONS`` names (once per process; a module that cannot be
    imported fails here, naming itself)."""
    for name in names():
        if name not in _loaded:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ImportError(f"{ENV} names {name!r}, which cannot be imported: {e}") from e
            _loaded.add(name)
