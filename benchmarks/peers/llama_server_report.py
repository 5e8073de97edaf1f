"""The table and the goals of benchmarks/peers/llama_server.py, from its JSON.

Each question was asked of both systems in several rounds; a row gives each system's best round
(the least disturbed on a shared machine) and the range over the rounds, and says whether the
goal holds between the best rounds.
"""
from __future__ import annotations


def _range(xs: list[float]) -> list[float]:
    return [min(xs), max(xs)]


def _pair(out: dict, section: str, question: str | None, *path: str, higher: bool = True,
          ours: str = "linstream") -> dict | None:
    """Best round and range of each system for one figure (out[section][question][system][round]
    then `path`; question None: out[section][system][round]); None where it was not asked.
    `ours`: the key of linstream's rounds (another way of asking it: its /v1/completions)."""
    q = out.get(section) or {}
    q = q if question is None else q.get(question)
    if not q or not q.get(ours) or not q.get("llama_cpp"):
        return None
    res = {}
    for system, key in (("linstream", ours), ("llama_cpp", "llama_cpp")):
        xs = []
        for r in q[key]:
            for k in path:
                r = r[k]
            xs.append(r)
        res[system] = {"best": max(xs) if higher else min(xs), "range": _range(xs), "rounds": xs}
    return res


def rows(out: dict) -> list[dict]:
    """One dict per figure: question, unit, each system's best and range, linstream / llama.cpp,
    and the goal with whether it is met (None for a figure without one)."""
    table = []

    def add(question, unit, pair, goal=None, met=None):
        if pair is not None:
            table.append({"question": question, "unit": unit, **pair,
                          "ratio": pair["linstream"]["best"] / pair["llama_cpp"]["best"], "goal": goal,
                          "met": None if met is None else bool(met(pair))})

    def faster(p):
        return p["linstream"]["best"] >= p["llama_cpp"]["best"]
    for t in (1, 2):
        add(f"batch-1 decode, {t} thread{'s' * (t > 1)} (llama-bench tg128)", "tok/s",
            _pair(out, "in_process", f"decode_t{t}", "tokens_per_s"), "ms/token <= 1.0x llama-bench tg", faster)
        add("  the same, tokens per CPU-second (process)", "tok/cpu-s",
            _pair(out, "in_process", f"decode_t{t}", "tokens_per_cpu_s"))
    add("prefill, 2,048 tokens, 1 thread (llama-bench pp2048)", "tok/s",
        _pair(out, "in_process", "prefill", "tokens_per_s"), "tokens/s >= pp2048", faster)
    add("  the same, tokens per CPU-second (process)", "tok/cpu-s", _pair(out, "in_process", "prefill", "tokens_per_cpu_s"))
    add("one SSE stream, median gap", "ms", _pair(out, "http", "single_stream", "itl_ms", "p50", higher=False),
        "<= llama-server's", lambda p: p["linstream"]["best"] <= p["llama_cpp"]["best"])
    add("one SSE stream, p99 gap", "ms", _pair(out, "http", "single_stream", "itl_ms", "p99", higher=False))
    add("one SSE stream, mean time per token (first event to last)", "ms",
        _pair(out, "http", "single_stream", "gap_mean_ms", higher=False))
    add("one SSE stream, tokens per server CPU-second", "tok/cpu-s",
        _pair(out, "http", "single_stream", "tokens_per_server_cpu_s"))
    add("one SSE stream, time to first token, median (create -> generate)", "ms",
        _pair(out, "http", "single_stream", "ttft_ms", "p50", higher=False), "<= llama-server's",
        lambda p: p["linstream"]["best"] <= p["llama_cpp"]["best"])
    by_completions = {"ours": "linstream_completions", "higher": False}
    add("one SSE stream by /v1/completions, median gap", "ms",
        _pair(out, "http", "single_stream", "itl_ms", "p50", **by_completions), "<= llama-server's",
        lambda p: p["linstream"]["best"] <= p["llama_cpp"]["best"])
    add("one SSE stream by /v1/completions, time to first token, median", "ms",
        _pair(out, "http", "single_stream", "ttft_ms", "p50", **by_completions), "<= llama-server's",
        lambda p: p["linstream"]["best"] <= p["llama_cpp"]["best"])
    for c in (out.get("http") or {}).get("levels", []):
        tps = _pair(out, "http", f"clients_{c}", "tokens_per_s")
        p50 = _pair(out, "http", f"clients_{c}", "itl_ms", "p50", higher=False)
        p99 = _pair(out, "http", f"clients_{c}", "itl_ms", "p99", higher=False)
        if c == 64 and tps and p50 and p99:
            add(f"{c} clients, tokens/s", "tok/s", tps, ">= 3x llama-server's tokens/s, and p99 gap <= 3x median",
                lambda p, p50=p50, p99=p99: p["linstream"]["best"] >= 3 * p["llama_cpp"]["best"]
                and p99["linstream"]["best"] <= 3 * p50["linstream"]["best"])
        else:
            add(f"{c} clients, tokens/s", "tok/s", tps)
        add(f"{c} clients, median gap", "ms", p50)
        add(f"{c} clients, p99 gap", "ms", p99)
        add(f"{c} clients, tokens per server CPU-second", "tok/cpu-s",
            _pair(out, "http", f"clients_{c}", "tokens_per_server_cpu_s"))
    add("cold start: process start -> answering HTTP", "s", _pair(out, "cold_start", None, "up_s", higher=False))
    add("cold start: process start -> first token of a 16-token prompt", "s",
        _pair(out, "cold_start", None, "first_token_s", higher=False), "<= 2x llama-server's",
        lambda p: p["linstream"]["best"] <= 2 * p["llama_cpp"]["best"])
    add("  the same, the server's CPU time", "cpu-s", _pair(out, "cold_start", None, "cpu_s", higher=False))
    return table


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) >= 1 else f"{x:.3f}"


def _cell(s: dict) -> str:
    lo, hi = s["range"]
    return _fmt(s["best"]) + ("" if _fmt(lo) == _fmt(hi) else f" ({_fmt(lo)}-{_fmt(hi)})")


def render(table: list[dict]) -> str:
    head = f"{'question':62s} {'unit':9s} {'linstream':>22s} {'llama.cpp':>22s} {'ratio':>6s}  goal"
    lines = [head, "-" * len(head)]
    for r in table:
        goal = "" if r["goal"] is None else f"{'MET' if r['met'] else 'not met'}: {r['goal']}"
        lines.append(f"{r['question']:62s} {r['unit']:9s} {_cell(r['linstream']):>22s} {_cell(r['llama_cpp']):>22s} "
                     f"{r['ratio']:6.2f}  {goal}")
    return "\n".join(lines)
