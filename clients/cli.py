"""The client side of the `linstream` command line (typer): the app and its entry; the commands are
commands.py's (generate, chat, bench, loadtest). `serve` is registered on the same app by
linstream/cli.py, which owns the entry point, so that clients never import the server."""
from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def root():
    """linstream: a streaming inference server for recurrent LMs, with explicit sessions."""


def main():
    import httpx

    from . import commands  # noqa: F401  (registers the client commands on `app`)
    try:
        app()
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # one line, not a traceback
        u = e.request.url
        typer.echo(f"cannot reach {u.scheme}://{u.netloc.decode()}: is linstream serve running? set LINSTREAM_URL",
                   err=True)
        raise SystemExit(1) from None
