"""`linstream` command line (typer): serve, generate, chat, bench, loadtest."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def root():
    """linstream: a streaming inference server for recurrent LMs, with explicit sessions."""


@app.command()
def serve(
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", "-m", help="model name or checkpoint dir; repeat to serve several (first = default)")] = None,
    host: Annotated[Optional[str], typer.Option(help="bind address [env LINSTREAM_HOST]")] = None,
    port: Annotated[Optional[int], typer.Option(help="port [env LINSTREAM_PORT]")] = None,
    max_sessions: Annotated[Optional[int], typer.Option(help="sessions in memory per recurrent model")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (0 = default)")] = None,
    store: Annotated[Optional[str], typer.Option(help="memory | disk:PATH | redis://HOST:PORT/DB [env LINSTREAM_STORE]")] = None,
    session_ttl: Annotated[Optional[float], typer.Option(help="seconds idle before a session expires (0 = never)")] = None,
    api_key: Annotated[Optional[list[str]], typer.Option(help="require this bearer key (repeatable)")] = None,
    api_key_file: Annotated[Optional[str], typer.Option(help="file with one key per line")] = None,
    max_connections: Annotated[Optional[int], typer.Option(help="connections open at once; more get 503 [default 1024]")] = None,
    prefix_cache_bytes: Annotated[Optional[int], typer.Option(
        help="bytes of OpenAI requests' prefix states kept, so a re-sent conversation prefills only its new part "
             "(0 = off) [default 256 MiB]")] = None,
    prefix_cache_shared: Annotated[Optional[bool], typer.Option(
        "--prefix-cache-shared/--prefix-cache-per-key",
        help="share cached prefix states across API keys (single tenant) [default per key]")] = None,
    log_level: Annotated[str, typer.Option()] = "info",
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
    import uvicorn

    from server.app import create_app
    from server.connections import fd_headroom, protocol
    from server.settings import Settings
    given = {"models": model, "host": host, "port": port, "max_sessions": max_sessions, "threads": threads,
             "api_keys": api_key, "api_key_file": api_key_file, "store": store, "session_ttl": session_ttl,
             "max_connections": max_connections, "prefix_cache_bytes": prefix_cache_bytes,
             "prefix_cache_shared": prefix_cache_shared}
    settings = Settings(**{k: v for k, v in given.items() if v is not None and v != []})
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: streams run on, then end cleanly
            rt = getattr(app.state, "runtime", None)
            if rt is not None:
                rt.begin_drain()
            super().handle_exit(sig, frame)

    conns = fd_headroom(settings.max_connections)
    Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                          http=protocol(settings.header_timeout, conns, settings.max_header_bytes), timeout_keep_alive=settings.keep_alive_timeout,
                          timeout_graceful_shutdown=settings.graceful_shutdown_s)).run()


def _reexec_with_jemalloc(required: bool):
    """Run this same command again with libjemalloc preloaded: an allocator cannot be swapped
    once the process has started, and glibc's keeps freed decode buffers (README "Soak").
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
    os.execve(sys.executable, [sys.executable, "-m", "clients", *sys.argv[1:]], env)


def main():
    from . import commands  # noqa: F401  (registers the client commands on `app`)
    app()
