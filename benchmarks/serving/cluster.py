"""Replicas behind HAProxy sharing one Redis (`linstream serve --replicas N`): what they gain and
what they cost, on this machine.

    python -m benchmarks.serving.cluster                  # every part
    python -m benchmarks.serving.cluster --part failover  # one part (the others are kept in the JSON)

Parts (results/serving/cluster.json, one key each):
  throughput  C clients, each create -> generate M tokens -> delete, over and over for D seconds:
              aggregate tokens/s through the proxy with 2 replicas / one replica direct (each on
              its own Redis), measured in turns for R rounds; HAProxy's CPU per token, Redis bytes
              received per token, bytes of the responses per token
  prefix      a T-turn OpenAI chat re-sending its history through the proxy with 3 replicas and no
              affinity key (HAProxy spreads the turns round robin): the share of turns that start
              from a prefix (this replica's cache or the Redis tier), then again after killing the
              replica that served the last turn; Redis bytes written per turn
  affinity    S sessions x R turns (push, generate 8) through the proxy: 409s, lease hand-overs
  failover    K times: SIGKILL the replica streaming a session; the time from the kill to the
              first token of the same request sent again (served by another replica), p50/p99
  capacity    bytes of state per session for each shipped model, and Redis memory per stored
              session (measured on N sessions), scaled to 10^6
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import redis

from benchmarks.common import command, pct_ms, process_cpu, write_json
from harness.cluster import LocalCluster, free_ports
from harness.local_server import LocalServer, wait_compiled
from linstream.cluster import start_redis

OUT = "benchmarks/results/serving/cluster.json"
MODEL = "linear"


# ---- throughput -------------------------------------------------------------------------------

async def load(url: str, clients: int, seconds: float, m: int, stream: bool) -> dict:
    """`clients` loops of create -> generate m -> delete for `seconds`; -> tokens, requests, errors."""
    st = {"tokens": 0, "generations": 0, "errors": 0, "response_bytes": 0}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        deadline = time.perf_counter() + seconds

        async def one(k: int):
            while time.perf_counter() < deadline:
                try:
                    r = await c.post("/v1/sessions", json={"prompt": f"Client {k} says: once upon a time"})
                    sid = r.json()["id"]
                    body = {"max_tokens": m, "temperature": 0.8, "top_p": 0.95, "stream": stream}
                    if stream:
                        async with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as g:
                            async for line in g.aiter_lines():
                                st["tokens"] += line == "event: token"
                            st["response_bytes"] += g.num_bytes_downloaded
                    else:
                        g = await c.post(f"/v1/sessions/{sid}/generate", json=body)
                        st["tokens"] += len(g.json()["tokens"])
                    st["generations"] += 1
                    await c.delete(f"/v1/sessions/{sid}")
                except (httpx.HTTPError, KeyError, ValueError):
                    st["errors"] += 1
                    await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await asyncio.gather(*[one(k) for k in range(clients)])
        st["wall_s"] = time.perf_counter() - t0
    st["tokens_per_s"] = round(st["tokens"] / st["wall_s"], 1)
    st["response_bytes_per_token"] = round(st["response_bytes"] / max(1, st["tokens"]), 1)
    return st


def redis_in_bytes(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_input_bytes"])


def throughput(a) -> dict:
    """One replica direct and two behind HAProxy, both up for the whole run and measured in turns
    (A B A B ...): the machine's other load drifts, and each round's ratio compares neighbours."""
    out = {"clients": a.clients, "max_tokens": a.tokens, "seconds_per_round": a.seconds, "rounds": a.rounds,
           "stream": a.stream, "compile": a.compile}
    with tempfile.TemporaryDirectory() as d:
        port = free_ports(1)
        rd = start_redis(port, d)
        srv = c = None
        try:
            srv = LocalServer([MODEL], {"LINSTREAM_STORE": f"redis://127.0.0.1:{port}/0"}, "--compile", a.compile,
                              threads=1)
            c = LocalCluster(2, [MODEL], "--compile", a.compile)
            if a.compile != "off":
                for url in (srv.url, c.replica_url(0), c.replica_url(1)):
                    wait_compiled(url, 1800)
            hp = haproxy_pid(c)
            sides = {"one_replica_direct": (srv.url, redis.Redis(port=port)),
                     "two_replicas_via_haproxy": (c.url, redis.Redis.from_url(c.redis_url))}
            for url, _ in sides.values():
                asyncio.run(load(url, 8, 3, 16, a.stream))  # warm
            runs = {k: [] for k in sides}
            for rnd in range(a.rounds):
                for k, (url, r) in sides.items():
                    cpu0, before = process_cpu(hp), redis_in_bytes(r)
                    st = asyncio.run(load(url, a.clients, a.seconds, a.tokens, a.stream))
                    st["redis_bytes_in_per_token"] = round((redis_in_bytes(r) - before) / max(1, st["tokens"]), 1)
                    if k.startswith("two"):
                        st["haproxy_cpu_us_per_token"] = round(1e6 * (process_cpu(hp) - cpu0) / max(1, st["tokens"]), 2)
                    runs[k].append(st)
                    print(f"  round {rnd} {k}: {st['tokens_per_s']} tok/s")
            out.update(runs)
            out["ratio_per_round"] = [round(two["tokens_per_s"] / one["tokens_per_s"], 3)
                                      for one, two in zip(runs["one_replica_direct"], runs["two_replicas_via_haproxy"])]
            out["ratio_median"] = statistics.median(out["ratio_per_round"])
            out["server_rss_bytes"] = {"one_replica": srv.stats()["rss_bytes"],
                                       "replicas": [rss(c.pid(i)) for i in range(2)]}
        finally:
            for x in (srv, c):
                if x is not None:
                    x.stop()
            rd.terminate()
    print(f"throughput: two replicas via HAProxy / one direct, per round {out['ratio_per_round']}, "
          f"median {out['ratio_median']}")
    return out


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(pid)


def haproxy_pid(c: LocalCluster) -> int:
    for child in Path(f"/proc/{c.proc.pid}/task/{c.proc.pid}/children").read_text().split():
        if b"haproxy" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise LookupError("no haproxy")


# ---- prefix tier --------------------------------------------------------------------------------

SAVED = "linstream_prefix_cache_tokens_saved_total"
WRITTEN = "linstream_prefix_tier_written_bytes_total"


def chat_turns(c: LocalCluster, client: httpx.Client, messages: list, turns: int, rows: list) -> None:
    for t in range(turns):
        messages.append({"role": "user", "content": f"Tell me more about the {t}th part of the story."})
        saved0, written0 = c.metrics(SAVED), c.metrics(WRITTEN)
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0})
        r.raise_for_status()
        body = r.json()
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        i = c.index_of(r.headers["x-linstream-replica"])  # the replica that served the turn
        rows.append({"replica": r.headers["x-linstream-replica"], "prompt_tokens": body["usage"]["prompt_tokens"],
                     "saved": int(c.metric(SAVED, i) - saved0[i]),
                     "tier_bytes_written": int(c.metric(WRITTEN, i) - written0[i])})


def prefix(a) -> dict:
    c = LocalCluster(3, [MODEL], "--compile", "off")
    try:
        rows_before, rows_after, messages = [], [], []
        with httpx.Client(base_url=c.url, timeout=60) as client:
            chat_turns(c, client, messages, a.turns, rows_before)
            last = rows_before[-1]["replica"]
            c.signal(c.index_of(last), signal.SIGKILL)
            time.sleep(1.5)  # marked down
            chat_turns(c, client, messages, a.turns_after, rows_after)

        def share(rows):  # the first turn of a chat has no prefix to start from
            later = rows[1:] if rows is rows_before else rows
            return round(100 * sum(r["saved"] > 0 for r in later) / len(later), 1)
        res = {"turns": a.turns, "turns_after_kill": a.turns_after,
               "replicas_serving_turns": len({r["replica"] for r in rows_before}),
               "turns_on_another_replica_than_the_last": sum(
                   x["replica"] != y["replica"] for x, y in itertools.pairwise(rows_before)),
               "hit_percent": share(rows_before), "hit_percent_after_kill": share(rows_after),
               "prompt_tokens_prefilled_percent": round(100 * sum(r["prompt_tokens"] - r["saved"] for r in rows_before[1:]) /
                                                        sum(r["prompt_tokens"] for r in rows_before[1:]), 1),
               "tier_bytes_written_per_turn": round(statistics.mean(r["tier_bytes_written"] for r in rows_before)),
               "killed": last, "rows": rows_before + rows_after}
    finally:
        c.stop()
    print(f"prefix: {res['hit_percent']} % of turns 2..{a.turns} from a prefix ({res['turns_on_another_replica_than_the_last']} "
          f"on another replica than the turn before), {res['hit_percent_after_kill']} % after killing {res['killed']}")
    return res


# ---- affinity ---------------------------------------------------------------------------------

def affinity(a) -> dict:
    c = LocalCluster(3, [MODEL], "--compile", "off")
    try:
        r = redis.Redis.from_url(c.redis_url)
        handovers0, takeovers0 = c.metric("linstream_session_handovers_total"), c.metric("linstream_lease_takeovers_total")
        conflicts, homes, turns = 0, {}, 0

        async def run():
            nonlocal conflicts, turns
            async with httpx.AsyncClient(base_url=c.url, timeout=60) as client:
                async def one(k):
                    nonlocal conflicts, turns
                    s = (await client.post("/v1/sessions", json={"prompt": f"Session {k}."})).json()["id"]
                    seen = set()
                    for t in range(a.turns_per_session):
                        p = await client.post(f"/v1/sessions/{s}/push", json={"text": f" Turn {t}."})
                        g = await client.post(f"/v1/sessions/{s}/generate", json={"max_tokens": 8, "stream": False})
                        conflicts += (p.status_code == 409) + (g.status_code == 409)
                        seen |= {p.headers.get("x-linstream-replica"), g.headers.get("x-linstream-replica")}
                        turns += 1
                    homes[s] = seen
                await asyncio.gather(*[one(k) for k in range(a.sessions)])
        before = redis_in_bytes(r)
        asyncio.run(run())
        per_turn = (redis_in_bytes(r) - before) / max(1, turns)
        res = {"sessions": a.sessions, "turns_per_session": a.turns_per_session, "responses_409": conflicts,
               "lease_handovers": int(c.metric("linstream_session_handovers_total") - handovers0),
               "lease_takeovers": int(c.metric("linstream_lease_takeovers_total") - takeovers0),
               "sessions_on_more_than_one_replica": sum(len(v) > 1 for v in homes.values()),
               "replicas_used": len(set().union(*homes.values())),
               "redis_bytes_in_per_turn": round(per_turn, 1)}
    finally:
        c.stop()
    print(f"affinity: {res['responses_409']} 409s, {res['lease_handovers']} hand-overs in "
          f"{a.sessions} x {a.turns_per_session} turns over {res['replicas_used']} replicas")
    return res


# ---- failover ---------------------------------------------------------------------------------

def failover(a) -> dict:
    c = LocalCluster(3, [MODEL], "--compile", "off")
    times, served_by_other, exact = [], 0, 0
    try:
        with httpx.Client(base_url=c.url, timeout=60) as client:
            for k in range(a.failovers):
                assert c.wait_replicas(300)
                time.sleep(1.2)  # a replica started again is back in HAProxy's rotation (rise 2)
                sid = client.post("/v1/sessions", json={"prompt": f"Failover {k}: it was a dark night"}).json()["id"]
                t_kill, victim, first = None, None, []
                with client.stream("POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 2000, "temperature": 0}) as s:
                    victim = s.headers["x-linstream-replica"]
                    for line in s.iter_lines():
                        if line.startswith("data: {") and '"token"' in line:
                            first.append(json.loads(line[6:])["token"])
                            if len(first) == 8:
                                c.signal(c.index_of(victim), signal.SIGKILL)
                                t_kill = time.perf_counter()
                                break
                while True:  # the same request again, as a client does after a cut stream
                    try:
                        with client.stream("POST", f"/v1/sessions/{sid}/generate",
                                           json={"max_tokens": 8, "temperature": 0}) as s:
                            if s.status_code == 200:
                                for line in s.iter_lines():
                                    if line.startswith("data: {") and '"token"' in line:
                                        times.append(time.perf_counter() - t_kill)
                                        served_by_other += s.headers["x-linstream-replica"] != victim
                                        exact += json.loads(line[6:])["token"] == first[0]
                                        break
                                break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.02)
                print(f"  failover {k}: {1000 * times[-1]:.0f} ms")
    finally:
        c.stop()
    res = {"failovers": len(times), "p50_ms": pct_ms(times, 0.5, 1), "p99_ms": pct_ms(times, 0.99, 1),
           "max_ms": round(1000 * max(times), 1), "served_by_another_replica": served_by_other,
           "first_token_as_before_the_kill": exact}
    print(f"failover: p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms over {len(times)} kills")
    return res


# ---- capacity -------------------------------------------------------------------------------

def capacity(a) -> dict:
    import torch

    from linstream.model import WEIGHTS
    from linstream.model.lm import LM
    from linstream.model.snapshot import state_to_bytes
    per_model = {}
    for p in sorted(WEIGHTS.iterdir()):
        if not (p / "config.json").exists():
            continue
        m = LM.load(p).eval()
        with torch.no_grad():
            _, st = m(torch.zeros(1, a.context, dtype=torch.long), m.init_state(1))
        per_model[p.name] = {"state_bytes": st.row_nbytes(), "record_blob_bytes": len(state_to_bytes(st, m.fingerprint)),
                             "grows_with_context": any(st.time_dims[i] for i in range(len(st.layers)))}
    c = LocalCluster(1, [MODEL], "--compile", "off")
    try:
        r = redis.Redis.from_url(c.redis_url)
        used0 = int(r.info("memory")["used_memory"])

        async def make():
            async with httpx.AsyncClient(base_url=c.url, timeout=60) as client:
                sem = asyncio.Semaphore(16)

                async def one(k):
                    async with sem:
                        s = (await client.post("/v1/sessions", json={"prompt": f"Session {k}: ROMEO speaks."})).json()
                        await client.post(f"/v1/sessions/{s['id']}/generate", json={"max_tokens": 16, "stream": False})
                await asyncio.gather(*[one(k) for k in range(a.stored)])
        asyncio.run(make())
        per_session = (int(r.info("memory")["used_memory"]) - used0) / a.stored
    finally:
        c.stop()
    res = {"context_tokens_for_kv_models": a.context, "per_model": per_model, "stored_sessions_measured": a.stored,
           "redis_bytes_per_stored_session": round(per_session), "model_measured": MODEL,
           "redis_gib_per_million_sessions": round(per_session * 1e6 / 2 ** 30, 1)}
    print(f"capacity: {res['redis_bytes_per_stored_session']} B of Redis per {MODEL} session "
          f"-> {res['redis_gib_per_million_sessions']} GiB per 10^6")
    return res


PARTS = {"capacity": capacity, "affinity": affinity, "prefix": prefix, "failover": failover, "throughput": throughput}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=[*PARTS, "all"], default="all")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", default="auto", help="the replicas' --compile for the throughput part")
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--turns-after", type=int, default=10)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns-per-session", type=int, default=200)
    ap.add_argument("--failovers", type=int, default=20)
    ap.add_argument("--stored", type=int, default=2000)
    ap.add_argument("--context", type=int, default=1000, help="tokens in a KV model's state (capacity)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    path = Path(a.out)
    res = json.loads(path.read_text()) if path.exists() else {}
    for name, part in PARTS.items():
        if a.part in (name, "all"):  # --no-stream's throughput is kept beside the streamed one
            res[name if a.stream or name != "throughput" else "throughput_json_bodies"] = {**part(a), "command": command()}
    res["machine"] = "2 CPU cores (AMD EPYC, AVX2), shared; every process of the cluster and the clients on them"
    write_json(path, res)


if __name__ == "__main__":
    main()
