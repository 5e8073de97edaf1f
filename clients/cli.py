"""The client side of the `linstream` command line (typer): the entry point over commands.py's
app (generate, chat, bench, loadtest). `serve` is registered on the same app by linstream/cli.py,
which owns the installed entry point, so that clients never import the server."""
from __future__ import annotations

import sys

import typer

from .commands import app

__all__ = ["app", "main"]


def main():
    try:
        app()
    except Exception as e:
        # a connection error is one line, not a traceback; httpx is imported by the commands that
        # use it, and `serve` does not
        httpx = sys.modules.get("httpx")
        if httpx is None or not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            raise
        u = e.request.url
        typer.echo(f"cannot reach {u.scheme}://{u.netloc.decode()}: is linstream serve running? set LINSTREAM_URL",
                   err=True)
        raise SystemExit(1) from None
