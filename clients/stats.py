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


# A client that reads tokens more than this much faster than the server made them was late: it
# took them in bursts (starved of CPU), and its inter-token figures are not the server's.
STARVED = 0.9


def starved(client_ms: float | None, server_ms: float | None) -> str | None:
    """A warning when the client's inter-token time is below the server's own per-token time
    (`per_token_ms` in each done event): the server cannot send tokens faster than it makes them,
    so such a client was starved of CPU and read them in bursts. None when the figures agree."""
    if not client_ms or not server_ms or client_ms >= STARVED * server_ms:
        return None
    return (f"warning: the client's inter-token time ({client_ms:.3f} ms) is below the server's own per-token time "
            f"({server_ms:.3f} ms): this client was starved of CPU and read tokens in bursts; trust the server's figure")
