"""The client commands of `linstream` on one typer app: generate, chat, bench, loadtest."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:  # the commands import the client (and httpx) when they run: `serve` never does
    from .sdk import Client

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def root():
    """linstream: a streaming inference server for recurrent LMs, with explicit sessions."""


URL = typer.Option("--url", envvar="LINSTREAM_URL", help="server base URL")
API_KEY = typer.Option("--api-key", envvar="LINSTREAM_API_KEY", help="the server's API key, if it requires one")
OUT = "prefix of the .json and .png written (default: a new folder NAME-YYYYmmdd-HHMMSS here)"
bench = typer.Typer(no_args_is_help=True, help="Benchmarks against a running server.")
app.add_typer(bench, name="bench")


def _run_dir(name: str) -> str:
    """Where a run writes when not told: a new folder under the current directory, named by the
    run, so that no earlier results (the shipped ones included) are written over."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}/{name}"


@app.command()
def generate(prompt: str, url: Annotated[str, URL] = "http://127.0.0.1:8000",
             api_key: Annotated[Optional[str], API_KEY] = None,
             model: Optional[str] = None, max_tokens: int = 200, temperature: float = 0.8, top_p: float = 0.95,
             seed: Optional[int] = None):
    """Stream a continuation of PROMPT to the terminal as it arrives."""
    from .sdk import Client, LinstreamError
    with Client(url, api_key) as c:
        try:
            s = c.create_session(prompt=prompt, model=model)
            stream = c.generate(s["id"], max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
            sys.stdout.write(prompt)
            for ev in stream:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            c.delete(s["id"])
        except LinstreamError as e:
            typer.echo(f"\nerror: {e}", err=True)
            raise typer.Exit(1) from None
    t = stream.done.timings
    typer.echo(f"\n[{stream.done.usage['completion_tokens']} tokens, ttft {t['ttft_ms']} ms, "
               f"{t['per_token_ms']} ms/token]", err=True)


CHAT_HELP = ("commands: /undo (takes back the last turn), /branch (goes on in a copy, the session kept as it is), "
             "/save [FILE] (state blob), /load FILE, /history, /help, /quit (deletes the session); "
             "any other line is sent (start it with // to send a line that starts with /); "
             "Ctrl-C leaves and keeps the session")


@app.command()
def chat(url: Annotated[str, URL] = "http://127.0.0.1:8000", api_key: Annotated[Optional[str], API_KEY] = None,
         model: Optional[str] = None,
         session: Annotated[Optional[str], typer.Option(help="continue this session (Ctrl-C printed its id)")] = None,
         max_tokens: int = 120, temperature: float = 0.8, top_p: float = 0.95):
    """Interactive loop on one session. Each line is pushed, then the model answers."""
    from .sdk import Client
    c = Client(url, api_key)
    sid = c.get_session(session)["id"] if session else c.create_session(model=model)["id"]
    typer.echo(f"session {sid}; {CHAT_HELP}")
    session = [sid]  # the current one: /load replaces it
    try:
        _chat_loop(c, session, max_tokens, temperature, top_p)
    except KeyboardInterrupt:
        typer.echo(f"\nsession kept; resume with: linstream chat --url {url} --session {session[0]}", err=True)
        return
    c.delete(session[0])


def _chat_loop(c: Client, session: list[str], max_tokens: int, temperature: float, top_p: float) -> None:
    from .sdk import LinstreamError
    sid = session[0]
    turns: list[int] = []  # the position before each turn of this loop, for /undo
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        cmd, _, arg = line.strip().partition(" ")
        try:
            if cmd == "/quit":
                return
            elif cmd == "/help":
                typer.echo(CHAT_HELP)
            elif cmd == "/save":
                info = c.get_session(sid)
                arg = arg or f"chat-{sid[5:13]}-{info['position']}.safetensors"
                Path(arg).write_bytes(c.state(sid))
                typer.echo(f"saved position {info['position']} to {arg}")
            elif cmd == "/load":
                new = c.restore(blob=Path(arg).read_bytes())
                c.delete(sid)
                sid = session[0] = new["id"]
                turns.clear()
                typer.echo(f"loaded {arg}: session {sid} at position {new['position']}")
            elif cmd == "/history":
                typer.echo(c.history(sid)["text"])
            elif cmd == "/undo":
                if not turns:
                    typer.echo("nothing to undo")
                    continue
                at = c.rewind(sid, turns.pop())["position"]
                typer.echo(f"back to position {at}")
            elif cmd == "/branch":
                new = c.fork(sid)
                typer.echo(f"on branch {new['id']} at position {new['position']}; session {sid} kept as it was")
                sid = session[0] = new["id"]
            elif cmd.startswith("/") and not cmd.startswith("//"):  # a mistyped command is never sent as text
                typer.echo(f"unknown command {cmd}; {CHAT_HELP}")
            else:
                if line.startswith("//"):
                    line = line[1:]
                pushed = c.push(sid, text=line + "\n")
                turns.append(pushed["position"] - pushed["tokens"])
                for ev in c.generate(sid, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=["\n\n"]):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
        except (LinstreamError, OSError) as e:
            typer.echo(f"error: {e}", err=True)


@app.command()
def rewind(session: str, position: int, url: Annotated[str, URL] = "http://127.0.0.1:8000",
           api_key: Annotated[Optional[str], API_KEY] = None,
           fork: Annotated[bool, typer.Option(help="make a new session there instead, the session kept")] = False):
    """Put SESSION back at POSITION of its history (or fork it there), and print the session."""
    import json

    from .sdk import Client, LinstreamError
    with Client(url, api_key) as c:
        try:
            out = c.fork(session, position) if fork else c.rewind(session, position)
        except LinstreamError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    typer.echo(json.dumps(out))


@bench.command("latency")
def bench_latency(url: Annotated[str, URL] = "http://127.0.0.1:8000", api_key: Annotated[Optional[str], API_KEY] = None,
                  models: Annotated[Optional[str], typer.Option(
                      help="comma-separated served models (default: every model the server serves)")] = None,
                  contexts: Annotated[str, typer.Option(help="comma-separated context lengths")] = "128,1024,4096,16384,32768",
                  tokens: Annotated[int, typer.Option(help="tokens streamed per measurement")] = 64,
                  out: Annotated[Optional[str], typer.Option(help=OUT)] = None):
    """Per-token latency over SSE vs context length, per model, against the KV-cache baseline
    (`python -m benchmarks.serving.latency` adds the same checkpoints stepped in-process)."""
    from .bench_latency import run
    from .sdk import Client
    names = models.split(",") if models else [m["id"] for m in Client(url, api_key).models()]
    run(url, names, [int(x) for x in contexts.split(",")], tokens, out or _run_dir("latency"), api_key)


@app.command()
def loadtest(url: Annotated[str, URL] = "http://127.0.0.1:8000", api_key: Annotated[Optional[str], API_KEY] = None,
             concurrency: Annotated[str, typer.Option(help="comma-separated levels")] = "1,8,64,256",
             duration: Annotated[float, typer.Option(help="seconds per level")] = 20.0,
             max_tokens: int = 64,
             model: Annotated[Optional[str], typer.Option(help="served model (default: the server's default)")] = None,
             prompt: str = "ROMEO:\nBut soft, what light through yonder window breaks?\n",
             out: Annotated[Optional[str], typer.Option(help=OUT)] = None):
    """C concurrent streaming sessions per level for a fixed duration; stops by itself."""
    from .loadtest import run
    run(url, [int(x) for x in concurrency.split(",")], duration, max_tokens, model, prompt, out or _run_dir("loadtest"),
        api_key)
