"""Small helpers shared by the benchmarks."""
from __future__ import annotations

import re


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary_ms(xs: list[float]) -> dict:
    return {k: (None if v is None else round(1000 * v, 4))
            for k, v in (("p50", pct(xs, 0.5)), ("p90", pct(xs, 0.9)), ("p99", pct(xs, 0.99)))}


def metric(text: str, name: str) -> float | None:
    """First sample of a Prometheus metric in exposition text."""
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None
