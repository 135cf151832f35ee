"""The statistics the reports use, in one place (None where a sample is empty)."""

from __future__ import annotations

import math
import statistics
import time


def percentile(xs, q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan when empty."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def pct(xs, q: float) -> float | None:
    """:func:`percentile`, None when empty."""
    return percentile(xs, q) if len(xs) else None


def median(xs) -> float:
    return float(statistics.median(xs))


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def ratio(a, b) -> float | None:
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def nearest_rank(xs, q: float) -> float | None:
    """The median (q = 0.5) or the nearest-rank ``q`` quantile (q in [0, 1]); None when empty."""
    xs = sorted(xs)
    if not xs:
        return None
    return float(statistics.median(xs)) if q == 0.5 else xs[min(int(q * len(xs)), len(xs) - 1)]


def median_call_s(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn()`` after two untimed warm-up calls."""
    fn()
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
