"""The `linstream` command: `serve` (the server, below) beside the client commands
(clients/commands.py) on clients.cli's typer app. The one module that imports both server and
clients, so that neither has to import the other."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from linstream.clients.cli import app
from linstream.clients.cli import main as _run


def _default(name: str) -> str:
    """A server setting's default, as `serve --help` shows it (the Settings class holds it)."""
    from linstream.server.core.settings import Settings
    f = Settings.model_fields[name]
    value = f.default_factory() if f.default_factory else f.default
    if isinstance(value, list):  # the environment takes a list comma-separated or as JSON
        return f"(default {', '.join(value) or 'none'}; env LINSTREAM_{name.upper()}, comma-separated or a JSON list)"
    return f"(default {value}; env LINSTREAM_{name.upper()})"


def _version(asked: bool):
    if asked:
        from linstream.server.core.build import version_line
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _top(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="print the version (and torch's, and the kernel kind) and exit")] = False):
    """linstream: serve recurrent language models over HTTP with explicit sessions, and talk to a server."""


def _shipped() -> str:
    from linstream.model import WEIGHTS
    return ", ".join(sorted(p.name for p in WEIGHTS.iterdir() if (p / "config.json").exists())) or "none"


@app.command()
def serve(
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", "-m", help=f"model name (shipped: {_shipped()}) or checkpoint dir; repeat to serve several "
                              f"(first = default) {_default('models')}")] = None,
    name: Annotated[Optional[list[str]], typer.Option(
        help="the API's name for the model given by the same-numbered --model (default: its directory's name)")] = None,
    device: Annotated[Optional[str], typer.Option(help=f"cpu | cuda | cuda:N {_default('device')}")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        help=f"on a GPU, the whole model's dtype: float32 | bfloat16 | float16; on the CPU the same as --weights "
             f"{_default('dtype')}")] = None,
    weights: Annotated[Optional[str], typer.Option(
        help=f"the projections' format on the CPU: auto (as the checkpoint stores them) | float32 | bfloat16 | "
             f"float16 | int8 (weight-only); converted once and cached; states stay float32 {_default('weights')}")] = None,
    weight_cache: Annotated[Optional[bool], typer.Option(
        "--weight-cache/--no-weight-cache",
        help=f"keep converted / packed weights in the compile cache's weights/ folder, mapped at later starts "
             f"{_default('weight_cache')}")] = None,
    chat_template: Annotated[Optional[str], typer.Option(
        help="a chat template (Jinja, or a tokenizer_config.json) used instead of the checkpoint's own")] = None,
    host: Annotated[Optional[str], typer.Option(help=f"bind address {_default('host')}")] = None,
    port: Annotated[Optional[int], typer.Option(help=f"port {_default('port')}")] = None,
    max_sessions: Annotated[Optional[int], typer.Option(
        help=f"sessions in memory per recurrent model {_default('max_sessions')}")] = None,
    max_state_bytes: Annotated[Optional[int], typer.Option(
        help=f"bytes of session states in memory per recurrent model: fewer slots than --max-sessions where "
             f"one state is large {_default('max_state_bytes')}")] = None,
    threads: Annotated[Optional[int], typer.Option(
        help=f"torch threads, 0 = one fewer than the CPUs (the event loop keeps one) {_default('threads')}")] = None,
    store: Annotated[Optional[str], typer.Option(
        help=f"memory | disk:PATH | redis://HOST:PORT/DB {_default('store')}")] = None,
    session_ttl: Annotated[Optional[float], typer.Option(
        help=f"seconds idle before a session expires, 0 = never {_default('session_ttl')}")] = None,
    api_key: Annotated[Optional[list[str]], typer.Option(
        help="require this bearer key (repeatable) (default none: no key needed; env LINSTREAM_API_KEYS, "
             "comma-separated or a JSON list)")] = None,
    api_key_file: Annotated[Optional[str], typer.Option(
        help="file with one key per line (default none; env LINSTREAM_API_KEY_FILE)")] = None,
    metrics_key: Annotated[Optional[str], typer.Option(
        help="the operator's bearer key for /metrics, which no API key opens (default none: with API keys set, "
             "/metrics is refused; env LINSTREAM_METRICS_KEY)")] = None,
    max_connections: Annotated[Optional[int], typer.Option(
        help=f"connections open at once; more get 503 {_default('max_connections')}")] = None,
    compile: Annotated[Optional[str], typer.Option(
        help=f"auto | on | off: compiled decode step, warmed in the background {_default('compile')}")] = None,
    gemm: Annotated[Optional[str], typer.Option(
        help=f"own | inductor | onednn: the compiled step's matmuls: our kernel (AVX-512 or AVX2; inductor's "
             f"where the CPU has neither), inductor's GEMM template, or oneDNN's matmul (model/compiled/gemm.py; "
             f"timed in docs/benchmarks.md) {_default('gemm')}")] = None,
    step_runtime: Annotated[Optional[str], typer.Option(
        help=f"aoti | dynamo: the compiled step built ahead of time into a library (model/compiled/aot.py), or "
             f"torch.compile's function {_default('step_runtime')}")] = None,
    prefix_cache_bytes: Annotated[Optional[int], typer.Option(
        help=f"bytes of OpenAI requests' prefix states kept, so a re-sent conversation prefills only its new part "
             f"(0 = off) {_default('prefix_cache_bytes')}")] = None,
    prefix_cache_shared: Annotated[Optional[bool], typer.Option(
        "--prefix-cache-shared/--prefix-cache-per-key",
        help="share cached prefix states across API keys (single tenant) [default per key]")] = None,
    replica_name: Annotated[Optional[str], typer.Option(
        help="this replica's name in the X-Linstream-Replica header and in 409 session_owned_elsewhere "
             "(default hostname:port; env LINSTREAM_REPLICA_NAME)")] = None,
    drain_notice: Annotated[Optional[float], typer.Option(
        help=f"on SIGTERM, seconds /health answers 503 before the server stops listening, so that a proxy moves "
             f"traffic away first {_default('drain_notice_s')}")] = None,
    replicas: Annotated[Optional[int], typer.Option(
        min=1, help="start this many replica processes on the next ports and HAProxy in front of them on --port, "
                    "sharing --store (a Redis; default: a redis-server started here) (docs/scaling.md)")] = None,
    allowed_origins: Annotated[Optional[list[str]], typer.Option(
        help=f"let browser pages on this origin call the API (CORS; repeatable or comma-separated; * = any) "
             f"{_default('allowed_origins')}")] = None,
    log_format: Annotated[Optional[str], typer.Option(
        help=f"text | json (one object per line: time, level, logger, message, request_id, replica) "
             f"{_default('log_format')}")] = None,
    access_log: Annotated[Optional[bool], typer.Option(
        "--access-log/--no-access-log", help=f"a log line per request {_default('access_log')}")] = None,
    log_level: Annotated[str, typer.Option(
        help="uvicorn's log level: critical | error | warning | info | debug")] = "info",
    allocator: Annotated[str, typer.Option(
        envvar="LINSTREAM_ALLOCATOR",
        help="auto | system | jemalloc: restart under libjemalloc (LD_PRELOAD), which keeps resident memory "
             "flat under load; auto does so where libjemalloc is installed")] = "auto",
):
    """Serve models over HTTP. Unset options come from LINSTREAM_* environment variables."""
    if allocator not in ("auto", "system", "jemalloc"):
        raise typer.BadParameter("use auto, system or jemalloc", param_hint="--allocator")
    if allocator != "system":
        _reexec_with_jemalloc(required=allocator == "jemalloc")
    if compile not in (None, "auto", "on", "off"):
        raise typer.BadParameter("use auto, on or off", param_hint="--compile")
    if gemm not in (None, "own", "inductor", "onednn"):
        raise typer.BadParameter("use own, inductor or onednn", param_hint="--gemm")
    if step_runtime not in (None, "aoti", "dynamo"):
        raise typer.BadParameter("use aoti or dynamo", param_hint="--step-runtime")
    given = {"models": model, "host": host, "port": port, "max_sessions": max_sessions,
             "max_state_bytes": max_state_bytes, "threads": threads,
             "api_keys": api_key, "api_key_file": api_key_file, "metrics_key": metrics_key, "store": store,
             "session_ttl": session_ttl,
             "max_connections": max_connections, "names": name, "device": device, "dtype": dtype, "weights": weights,
             "weight_cache": weight_cache, "chat_template": chat_template,
             "compile": compile, "gemm": gemm, "step_runtime": step_runtime,
             "prefix_cache_bytes": prefix_cache_bytes, "prefix_cache_shared": prefix_cache_shared,
             "replica_name": replica_name, "drain_notice_s": drain_notice,
             "allowed_origins": [o.strip() for x in allowed_origins or () for o in x.split(",") if o.strip()],
             "log_format": log_format, "access_log": access_log}
    given = {k: v for k, v in given.items() if v is not None and v != []}
    if replicas is not None:
        from linstream.cluster import serve_cluster
        raise SystemExit(serve_cluster(replicas, given, log_level, allocator))
    import gc

    import uvicorn
    from pydantic import ValidationError
    from pydantic_settings.exceptions import SettingsError

    from linstream.server.core import logs
    from linstream.server.core.settings import Settings, bad_settings
    from linstream.server.engine.loading import check_checkpoints
    try:
        settings = Settings(**given)
    except (ValidationError, SettingsError) as e:  # one line naming the option or variable, no traceback
        raise SystemExit(f"linstream serve: {bad_settings(e, given)}") from None
    shared = settings.store.startswith(("redis://", "rediss://", "unix://"))  # replicas' lines may meet: name them
    log_config = logs.config(settings.log_format, log_level, settings.replica_name, named=shared)
    logs.configure(log_config)  # the server's own lines (the compile's progress) beside uvicorn's, from now on
    check_checkpoints(settings)  # a checkpoint that cannot be served: one line and exit 1, before the server starts
    from linstream.server.api.connections import fd_headroom, protocol
    from linstream.server.app import create_app
    app = create_app(settings)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                # what is made by now (the imports' modules and classes, the models) lives as long
                # as the process: frozen out of the collector's sight, so that a full collection,
                # which holds the GIL and so stalls every stream, walks only what requests make
                gc.collect()
                gc.freeze()
                typer.echo(banner(app.state.runtime, settings))

        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: streams run on, then end cleanly
            rt = getattr(app.state, "runtime", None)
            if rt is not None and settings.drain_notice_s and not rt.leaving and rt.loop is not None:
                rt.leaving = True  # /health says so first; everything else is served as before for the notice
                rt.loop.call_soon_threadsafe(rt.loop.call_later, settings.drain_notice_s, self.noticed, sig)
                return
            if rt is not None:
                rt.begin_drain()
            super().handle_exit(sig, frame)

        def noticed(self, sig):  # the drain notice is over: stop as on a signal, unless a second one did already
            if not self.should_exit:
                self.handle_exit(sig, None)

    conns = fd_headroom(settings.max_connections)
    Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, log_config=log_config,
                          access_log=settings.access_log,
                          http=protocol(settings.header_timeout, conns, settings.max_header_bytes,
                                        min(1.0, settings.keep_alive_timeout)), timeout_keep_alive=settings.keep_alive_timeout,
                          timeout_graceful_shutdown=settings.graceful_shutdown_s)).run()


def banner(rt, settings) -> str:
    """What `serve` prints once it listens: one line per model, the store, where the docs are."""
    import re
    lines = []
    for i, (name, e) in enumerate(rt.engines.items()):
        mixers = "+".join(dict.fromkeys(e.model.cfg.layer_mixers))
        state = f"{e.empty.row_nbytes(0) / 1024:.1f} KiB state per session"
        if e.kv:
            state += " + a KV cache growing with its context"
        lines.append(f"model {name}{' (default)' if i == 0 else ''}: {e.model.num_params() / 1e6:.2f}M parameters, "
                     f"mixer {mixers}, {state}")
    store = re.sub(r"//[^/@]*@", "//***@", settings.store)  # no password in the log
    lines.append(f"store {store}" + (" (sessions last only as long as this process)" if store == "memory" else ""))
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    lines.append(f"API docs: http://{host}:{settings.port}/docs")
    return "\n".join(lines)


def _reexec_with_jemalloc(required: bool):
    """Run this same command again with libjemalloc preloaded: an allocator cannot be swapped
    once the process has started, and glibc's keeps freed decode buffers (server/core/heap.py says why).
    Without the library: an error if it was asked for by name, else go on with glibc's."""
    import ctypes.util
    import os
    import sys
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload:
        return  # already under it
    lib = ctypes.util.find_library("jemalloc")
    if lib is None:
        if not required:
            return
        raise typer.BadParameter("libjemalloc not found (Debian: apt-get install libjemalloc2)", param_hint="--allocator")
    env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, [preload, lib]))}
    os.execve(sys.executable, [sys.executable, "-m", "linstream", *sys.argv[1:]], env)


def main():
    """`serve` is registered above, at import, so it lists first; the client commands after it."""
    _run()
