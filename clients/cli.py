"""The client side of the `linstream` command line (typer): the entry point over commands.py's
app (generate, chat, bench, loadtest). `serve` is registered on the same app by linstream/cli.py,
which owns the installed entry point, so that clients never import the server."""
from __future__ import annotations

import typer

from .commands import app

__all__ = ["app", "main"]


def main():
    import httpx

    try:
        app()
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # one line, not a traceback
        u = e.request.url
        typer.echo(f"cannot reach {u.scheme}://{u.netloc.decode()}: is linstream serve running? set LINSTREAM_URL",
                   err=True)
        raise SystemExit(1) from None
