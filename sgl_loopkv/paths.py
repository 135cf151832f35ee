"""Where sgl-loopkv keeps its files by default: a folder under the user's cache dir (converted models,
compiled kernels, the disk tier). A module of its own, below everything, so the kernels' builder can
name the folder without importing the launcher's configuration."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sgl-loopkv``, else ``~/.cache/sgl-loopkv``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sgl-loopkv"
