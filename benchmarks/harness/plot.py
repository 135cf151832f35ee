"""One way to draw a result's figure: a headless matplotlib grid, saved atomically where asked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def figure(path: Path, nrows: int = 1, ncols: int = 1, size=(11, 4), dpi: int = 110, **kw) -> Iterator:
    """Yields (fig, axes) as ``plt.subplots(nrows, ncols, **kw)`` returns them; on exit, tight layout and a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=size, **kw)
    try:
        yield fig, axes
        fig.tight_layout()
        tmp = Path(path).with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=dpi, metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        plt.close(fig)


def log_lengths(ax, lengths) -> None:
    """A log x axis labelled with exactly ``lengths`` (the log axis's own labels overlap ours)."""
    import matplotlib

    ax.set_xscale("log")
    ax.set_xticks(list(lengths), [str(L) for L in lengths])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
