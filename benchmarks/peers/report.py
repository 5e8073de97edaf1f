"""The table and the plot of benchmarks/peers/shipped.py, from its JSON."""
from __future__ import annotations

SYSTEMS = (("llama_cpp", "llama.cpp (llama-cpp-python)"), ("linstream", "linstream `mamba`"),
           ("transformers", "transformers Mamba"))


def _level(http: dict, system: str, conc: int) -> dict | None:
    return next((r for r in http.get(system) or [] if r["concurrency"] == conc), None)


def _get(d: dict | None, *keys):
    """d[k1][k2]..., None where any step is missing."""
    for k in keys:
        d = None if d is None else d.get(k)
    return d


def table_rows(out: dict) -> list[dict]:
    """One dict per figure: a value per system (None where it does not apply or failed), the
    quoted C++ llama.cpp figure where there is one (`reference`), and the unit."""
    ip, http, n = out["in_process"], out["http"], out["http"]["max_tokens"]
    get = _get
    rows = [
        {"figure": f"in-process decode, batch 1 (llama_decode / linstream's {get(ip, 'linstream', 'path') or 'eager'} "
                   f"step; lowest of {ip['rounds']} round medians)",
         "unit": "ms/token",
         "llama_cpp": get(ip, "llama_cpp", "ms_best_round"), "linstream": get(ip, "linstream", "ms_best_round"),
         "transformers": None, "reference": out["reference"]["in_process_ms_per_token"]},
        {"figure": "in-process decode, batch 1, linstream's eager step (LM.step)", "unit": "ms/token",
         "llama_cpp": None, "linstream": get(ip, "linstream_eager", "ms_best_round"),
         "transformers": None, "reference": None, "systems": ["linstream"]},
        {"figure": f"in-process decode, the same {out['peer_model']['layers']}-layer network in each "
                   "(same rounds; transformers: greedy generate, lowest of 3)", "unit": "ms/token",
         "llama_cpp": get(ip, "llama_cpp", "ms_best_round"), "linstream": get(ip, "linstream_twin", "ms_best_round"),
         "transformers": get(ip, "transformers", "ms_best_round"), "reference": None,
         "systems": [k for k, _ in SYSTEMS]},
    ]
    one = http.get("single_stream", {})
    rows += [{"figure": f"one SSE stream ({one.get('max_tokens')} tokens, greedy), median inter-token gap", "unit": "ms",
              "llama_cpp": get(one, "llama_cpp", "itl_ms", "p50"), "linstream": get(one, "linstream", "itl_ms", "p50"),
              "transformers": None, "reference": out["reference"]["sse_gap_ms"]},
             {"figure": "one SSE stream, mean time per token (first token to last)", "unit": "ms",
              "llama_cpp": get(one, "llama_cpp", "gap_mean_ms"), "linstream": get(one, "linstream", "gap_mean_ms"),
              "transformers": None, "reference": None}]
    for c in http["levels"]:
        rows.append({"figure": f"aggregate, {c} concurrent stream{'s' * (c > 1)} (create -> generate {n} -> delete, "
                               "over and over; sampled)", "unit": "tok/s",
                     "llama_cpp": get(_level(http, "llama_cpp", c), "tokens_per_s"),
                     "linstream": get(_level(http, "linstream", c), "tokens_per_s"),
                     "transformers": None, "reference": out["reference"]["tokens_per_s"].get(str(c))})
    for c in http["levels"]:
        rows.append({"figure": f"  the same, {c} stream{'s' * (c > 1)}: tokens per server CPU-second", "unit": "tok/cpu-s",
                     "llama_cpp": get(_level(http, "llama_cpp", c), "tokens_per_server_cpu_s"),
                     "linstream": get(_level(http, "linstream", c), "tokens_per_server_cpu_s"),
                     "transformers": None, "reference": None})
    for r in rows:
        r.setdefault("systems", ["llama_cpp", "linstream"])
        r["linstream_vs_llama_cpp"] = ratio(r)
    return rows


def ratio(r: dict) -> str | None:
    a, b = r["linstream"], r["llama_cpp"]
    if not a or not b:
        return None
    if r["unit"].startswith("tok/"):
        return f"{a / b:.2f}x"
    return f"{a / b:.1f}x slower" if a > b else f"{b / a:.1f}x faster"


def _cell(v, unit: str, failed: bool) -> str:
    if v is None:
        return "failed" if failed else "-"
    return f"{v:,.0f} {unit}" if unit.startswith("tok/") else f"{v:.3f} {unit.split('/')[0]}"


def render(rows: list[dict], out: dict) -> str:
    errs = out["errors"] | ({"llama_cpp": out["http"]["llama_cpp_error"]} if out["http"].get("llama_cpp_error") else {})
    head = ["figure", *[name for _, name in SYSTEMS], "linstream vs llama.cpp", "llama.cpp C++ (quoted)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["figure"]]
        cells += [_cell(r[key], r["unit"], key in errs and key in r["systems"]) for key, _ in SYSTEMS]
        cells += [r["linstream_vs_llama_cpp"] or "", _cell(r["reference"], r["unit"], False) if r["reference"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    agree = out["agreement"]
    m = out["machine"]
    cpu = out.get("cpu") or {"model": m["cpu"], "flags": []}  # files written before the flags were recorded
    notes = ["", f"machine: {cpu['model']} [{' '.join(cpu['flags'])}], {m['cores']} cores, one compute thread per "
                 f"system, 1-minute load average {m['load_average_1min_at_start']:.1f} at the start and "
                 f"{m['load_average_1min_at_end']:.1f} at the end; llama.cpp repacking "
                 f"{'off' if out.get('llama_no_repack') else 'on'}; versions {out['versions']}",
             f"peer model: random-weight Mamba-1, {out['peer_model']['layers']} mixer-only layers, "
             f"{out['peer_model']['parameters']:,} parameters, f32 (linstream `mamba`: "
             f"{out['in_process']['linstream']['parameters']:,}); tokenizer: {out['peer_model']['tokenizer']}",
             "llama.cpp over HTTP is llama-cpp-python's Python server (`python -m llama_cpp.server`), which runs one "
             "request at a time (the rest queue); the quoted figures are the C++ `llama-server`'s.",
             f"streams under load sample with {out['http'].get('sampling')}; llama.cpp's requests add top_k 0, min_p 0, "
             "repeat_penalty 1 (its sampler's defaults would add work linstream does not do), and forbid (logit_bias) "
             f"{out['http'].get('llama_cpp_forbidden_tokens')} tokens: end-of-text and the raw bytes that are not whole "
             "UTF-8 characters (see llama_bias in shipped.py)",
             *bursts(out["http"]),
             "same network, linstream vs each: " + "; ".join(
                 f"{k}: max |logit diff| {v['max_abs_logit_diff']:.2e}, greedy equal {v['greedy_tokens_equal']}"
                 + (f", tokenization equal {v['tokenization_equal']}" if "tokenization_equal" in v else "")
                 for k, v in agree.items() if isinstance(v, dict))]
    notes += [f"{k} DISAGREES with linstream on the same network: its figures are not like for like" for k, v in agree.items()
              if isinstance(v, dict) and (v["max_abs_logit_diff"] > 1e-3 or not v["greedy_tokens_equal"])]
    notes += [f"{k} FAILED: {v}" for k, v in errs.items()]
    return "\n".join(lines + notes)


def bursts(http: dict) -> list[str]:
    """A line for each measurement whose events came in bursts: mean time per token well above the
    median gap (tokens held back, then sent together), where the median gap misleads."""
    runs = [(f"one stream, {k}", http.get("single_stream", {}).get(k)) for k, _ in SYSTEMS[:2]]
    runs += [(f"{r['concurrency']} streams, {k}", r) for k, _ in SYSTEMS[:2] for r in http.get(k) or []]
    return [f"{name}: bursts (median gap {r['itl_ms']['p50']:.3f} ms, mean per token {r['gap_mean_ms']:.3f} ms; "
            f"{r['tokens']:,} tokens in {r['events']:,} events): read the mean" for name, r in runs
            if r and r["gap_mean_ms"] and r["itl_ms"]["p50"] and r["gap_mean_ms"] > 2 * r["itl_ms"]["p50"]]


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["table"]
    lat = [r for r in rows if not r["unit"].startswith("tok/")]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.8))
    w = 0.2
    for i, (key, name) in enumerate([*SYSTEMS, ("reference", "llama.cpp C++ (quoted)")]):
        xs = [j + (i - 1.5) * w for j, r in enumerate(lat) if r[key]]
        a.bar(xs, [r[key] for r in lat if r[key]], w, label=name, hatch="//" if key == "reference" else None,
              color=f"C{i}", alpha=0.6 if key == "reference" else 1.0)
    names = {"eager step": "in-process\n(eager step)", "same ": "in-process\n(same network)",
             "mean time": "one SSE stream\nmean per token", "median inter-token": "one SSE stream\nmedian gap"}
    a.set_xticks(range(len(lat)), [next((v for k, v in names.items() if k in r["figure"]), "in-process\n(shipped mamba)")
                                   for r in lat])
    a.set_ylabel("ms per token (median)")
    a.set_title("Per-token latency, batch 1, one thread")
    a.legend(fontsize=8)
    a.grid(True, axis="y", alpha=0.3)
    http = out["http"]
    for i, (key, name) in enumerate(SYSTEMS[:2]):
        lv = http.get(key) or []
        if lv:
            cs = [r["concurrency"] for r in lv]
            b.plot(cs, [r["tokens_per_s"] for r in lv], "o-", color=f"C{i}", label=name)
            c.plot(cs, [r.get("tokens_per_server_cpu_s") or 0 for r in lv], "o-", color=f"C{i}", label=name)
    ref = out["reference"]["tokens_per_s"]
    b.plot([int(k) for k in ref], list(ref.values()), "s--", color="C3", alpha=0.6, label="llama.cpp C++ server (quoted)")
    for ax, title, yl in ((b, "Throughput over HTTP", "aggregate tokens / s"),
                          (c, "Per server CPU-second (steady under outside load)", "tokens / server CPU-second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"concurrent clients (create -> generate {http['max_tokens']} -> delete)")
        ax.set_ylabel(yl)
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
