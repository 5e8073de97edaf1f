"""Prometheus metrics (prometheus-client), one registry per app so several apps can coexist.
Names and units follow Prometheus's conventions (seconds, bytes, `_total` counters) and, where
vLLM has the same series, vLLM's (`num_requests_running`, `e2e_request_latency_seconds`)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .build import build

LATENCY_BUCKETS = (.0005, .001, .002, .003, .005, .0075, .01, .015, .02, .03, .05, .075, .1, .2, .5, 1, 2, 5)
# a whole request: a health check's milliseconds to a long generation's minutes
REQUEST_BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("linstream_time_to_first_token_seconds", "Submit to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("linstream_inter_token_latency_seconds", "Between two tokens of one stream", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("linstream_decode_step_seconds", "One batched decode step", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("linstream_decode_batch_size", "Sessions per decode step", ["model"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.tokens = Counter("linstream_tokens_generated", "Tokens generated", ["model"], registry=r)
        self.prompt_tokens = Counter("linstream_prompt_tokens", "Tokens prefilled", ["model"], registry=r)
        self.requests = Counter("linstream_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.sessions = Gauge("linstream_active_sessions", "Sessions held in memory", ["model"], registry=r)
        self.state_bytes = Gauge("linstream_state_bytes", "Bytes of session state held", ["model"], registry=r)
        self.queue_depth = Gauge("linstream_queue_depth", "Prefills and generations waiting to start", ["model"],
                                 registry=r)
        self.spills = Counter("linstream_sessions_spilled", "Idle sessions whose slot was given to another", ["model"],
                              registry=r)
        self.reloads = Counter("linstream_sessions_reloaded", "Sessions brought back from the store", ["model"],
                               registry=r)
        self.expired = Counter("linstream_sessions_expired", "Sessions dropped after session_ttl idle", ["model"],
                               registry=r)
        self.unpersisted = Gauge("linstream_sessions_unpersisted",
                                 "Sessions whose latest state could not be written to the store yet", registry=r)
        self.heap_in_use = Gauge("linstream_heap_in_use_bytes", "Bytes allocated from the C heap and in use", registry=r)
        self.heap_free = Gauge("linstream_heap_free_bytes", "Bytes the allocator holds beyond those in use",
                               registry=r)
        self.rss = Gauge("linstream_resident_memory_bytes", "Resident memory of the server process", registry=r)
        self.prefix_hits = Counter("linstream_prefix_cache_hits", "Requests started from a cached prefix state (OpenAI, session create)",
                                   ["model"], registry=r)
        self.prefix_misses = Counter("linstream_prefix_cache_misses", "Requests with a prompt and no cached prefix of it", ["model"],
                                     registry=r)
        self.prefix_tokens_saved = Counter("linstream_prefix_cache_tokens_saved",
                                           "Prompt tokens not prefilled thanks to the prefix cache", ["model"], registry=r)
        self.prefix_evictions = Counter("linstream_prefix_cache_evictions", "Prefix states dropped for the byte budget",
                                        ["model"], registry=r)
        self.prefix_bytes = Gauge("linstream_prefix_cache_bytes", "Bytes of prefix states held", ["model"], registry=r)
        self.prefix_entries = Gauge("linstream_prefix_cache_entries", "Prefix states held", ["model"], registry=r)
        self.prefix_tier_hits = Counter("linstream_prefix_tier_hits", "Requests started from a prefix state read from Redis",
                                        ["model"], registry=r)
        self.prefix_tier_written = Counter("linstream_prefix_tier_written_bytes", "Bytes of prefix states written to Redis",
                                           registry=r)
        self.handovers = Counter("linstream_session_handovers", "Sessions taken from the store because another replica "
                                 "served them last (or this one restarted)", ["model"], registry=r)
        self.lease_takeovers = Counter("linstream_lease_takeovers", "Session leases taken from a replica found dead",
                                       registry=r)
        self.running = Gauge("linstream_num_requests_running", "Generations in the decode batch", ["model"], registry=r)
        self.waiting = Gauge("linstream_num_requests_waiting", "Generations and prefills waiting to start", ["model"],
                             registry=r)
        self.finished = Counter("linstream_generations_finished", "Generations ended, by finish reason (stop, length, "
                                "cancelled, shutdown, error)", ["model", "finish_reason"], registry=r)
        self.e2e = Histogram("linstream_e2e_request_latency_seconds", "A request from its arrival to the end of its "
                             "response (a stream's last event)", ["route"], buckets=REQUEST_BUCKETS, registry=r)
        Info("linstream_build", "This server's version, torch's, and the kind of our matmul this CPU runs",
             registry=r).info({k: str(v or "none") for k, v in build().items()})
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...

    def observe_engines(self, engines: dict) -> None:
        """The gauges read off each engine when /metrics is scraped: generations stepping and waiting."""
        for name, eng in engines.items():
            self.running.labels(name).set(sum(j.t_start is not None for j in list(eng.jobs)))
            self.waiting.labels(name).set(eng.queue_depth)


class CountRequests:
    """ASGI middleware: `linstream_requests{route, status}` for every HTTP request, counted when
    its response ends, and its time in `linstream_e2e_request_latency_seconds{route}`. The route is its template ("/v1/sessions/{sid}/push"), as FastAPI's router
    or the hot routes (server/api/hot_routes.py: scope["linstream.route"]) matched it, or "unmatched", so
    that no client can grow the set of labels; the status is "none" where no response was
    sent (the client left first)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, t0 = "none", time.perf_counter()

        async def sending(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = str(msg["status"])
            await send(msg)
        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("linstream.route") or getattr(scope.get("route"), "path", None) or "unmatched"
            rt = getattr(scope["app"].state, "runtime", None)
            if rt is not None:
                rt.metrics.requests.labels(route, status).inc()
                rt.metrics.e2e.labels(route).observe(time.perf_counter() - t0)
