"""Python SDK for linstream, sync (`Client`) and async (`AsyncClient`), on httpx + httpx-sse.

    from .sdk import Client
    c = Client()                                  # LINSTREAM_URL, LINSTREAM_API_KEY, LINSTREAM_TIMEOUT
    s = c.create_session(prompt="ROMEO:\\n")
    stream = c.generate(s["id"], max_tokens=50)
    for ev in stream:
        print(ev.text, end="", flush=True)
    print(stream.done.timings)

Server errors raise `LinstreamError` subclasses carrying the server's type and message (and its
`param` and `code`).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import aconnect_sse, connect_sse


class LinstreamError(Exception):
    def __init__(self, status: int, type: str, message: str):
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message = status, type, message


class InvalidRequest(LinstreamError): ...          # 400, 415, 422
class SnapshotRejected(InvalidRequest): ...        # 400 for a bad state blob
class NotFound(LinstreamError): ...                # 404
class SessionBusy(LinstreamError): ...             # 409
class TooLarge(LinstreamError): ...                # 413
class Unauthorized(LinstreamError): ...            # 401
class AtCapacity(LinstreamError): ...              # 503 (see retry_after)


def _raise(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json()["error"]
        etype, msg = err["type"], err["message"]
    except Exception:
        err, etype, msg = {}, "http_error", r.text[:200]
    cls = {404: NotFound, 409: SessionBusy, 413: TooLarge, 401: Unauthorized, 503: AtCapacity}.get(r.status_code)
    if cls is None:
        cls = SnapshotRejected if etype.startswith(("snapshot", "corrupt")) else (
            InvalidRequest if r.status_code < 500 else LinstreamError)
    e = cls(r.status_code, etype, msg)
    e.retry_after = r.headers.get("retry-after")
    e.param, e.code = err.get("param"), err.get("code")  # the field at fault; OpenAI's code where it has one
    raise e


@dataclass
class TokenEvent:
    token: int
    text: str
    position: int
    logprobs: Any = None


@dataclass
class Done:
    finish_reason: str
    usage: dict
    timings: dict
    persisted: bool = True  # False: the server's store was unreachable; it keeps the session in memory
    error: dict | None = None  # {"type", "message"} when finish_reason is "error"


def _sampling(max_tokens, temperature, top_p, top_k, seed, stop, logprobs) -> dict:
    body = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    for k, v in (("seed", seed), ("stop", stop), ("logprobs", logprobs)):
        if v is not None:
            body[k] = v
    return body


def _event(kind: str, data: str):
    """A token or done event. Every one of them carries data: httpx-sse reports the server's
    keep-alive comments, once an event with an `id:` has been seen, as an empty "message" event
    (the id persists, as the SSE spec says), which the callers skip."""
    d = json.loads(data)
    if kind == "token":
        return TokenEvent(d["token"], d["text"], d["position"], d.get("logprobs"))
    return Done(d["finish_reason"], d["usage"], d["timings"], d.get("persisted", True), d.get("error"))


@dataclass
class _Conf:
    base_url: str
    headers: dict = field(default_factory=dict)
    timeout: float = 60.0

    @classmethod
    def make(cls, base_url, api_key, timeout):
        url = base_url or os.environ.get("LINSTREAM_URL", "http://127.0.0.1:8000")
        key = api_key or os.environ.get("LINSTREAM_API_KEY")
        t = timeout or float(os.environ.get("LINSTREAM_TIMEOUT", "60"))
        return cls(url.rstrip("/"), {"Authorization": f"Bearer {key}"} if key else {}, t)


class GenerationStream:
    """Iterate for TokenEvents; `.done` holds the final Done once the stream ends."""

    def __init__(self, it):
        self._it, self.done = it, None

    def __iter__(self) -> Iterator[TokenEvent]:
        for ev in self._it:
            if isinstance(ev, Done):
                self.done = ev
            else:
                yield ev

    def close(self) -> None:
        """Stop reading: the connection closes and the server stops the generation; the session
        keeps exactly the tokens that were sent."""
        self._it.close()


def _json(r: httpx.Response):
    return r.json()


def _data(r: httpx.Response):
    return r.json()["data"]


def _nothing(r: httpx.Response) -> None:
    return None


class _Requests:
    """Every request of the API, written once. A method names the request and how to read its
    answer, and hands both to `_call`: `Client._call` sends it and returns the result,
    `AsyncClient._call` returns an awaitable of it. Only streaming differs (`generate`)."""

    # sessions
    def create_session(self, prompt: str | None = None, tokens: list[int] | None = None, model: str | None = None) -> dict:
        body = {k: v for k, v in (("prompt", prompt), ("tokens", tokens), ("model", model)) if v is not None}
        return self._call("POST", "/v1/sessions", _json, json=body)

    def get_session(self, sid: str) -> dict:
        return self._call("GET", f"/v1/sessions/{sid}", _json)

    def list_sessions(self) -> list[dict]:
        return self._call("GET", "/v1/sessions", _data)

    def history(self, sid: str) -> dict:
        return self._call("GET", f"/v1/sessions/{sid}/history", _json)

    def push(self, sid: str, text: str | None = None, tokens: list[int] | None = None) -> dict:
        body = {"text": text} if text is not None else {"tokens": tokens or []}
        return self._call("POST", f"/v1/sessions/{sid}/push", _json, json=body)

    def generate_text(self, sid: str, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                      top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
                      logprobs: int | None = None) -> dict:
        body = {**_sampling(max_tokens, temperature, top_p, top_k, seed, stop, logprobs), "stream": False}
        return self._call("POST", f"/v1/sessions/{sid}/generate", _json, json=body)

    def snapshot(self, sid: str) -> dict:
        return self._call("POST", f"/v1/sessions/{sid}/snapshot", _json)

    def state(self, sid: str) -> bytes:
        return self._call("GET", f"/v1/sessions/{sid}/state", lambda r: r.content)

    def restore(self, snapshot_id: str | None = None, blob: bytes | None = None, model: str | None = None) -> dict:
        if blob is not None:
            return self._call("POST", "/v1/sessions/restore", _json, content=blob,
                              params={"model": model} if model else None,
                              headers={"content-type": "application/octet-stream"})
        return self._call("POST", "/v1/sessions/restore", _json, json={"snapshot_id": snapshot_id})

    def fork(self, sid: str, position: int | None = None) -> dict:
        """A copy of the session, or of its history's first `position` tokens and the state there."""
        body = {"position": position} if position is not None else None
        return self._call("POST", f"/v1/sessions/{sid}/fork", _json, json=body)

    def rewind(self, sid: str, position: int) -> dict:
        """Put the session back at `position` of its history (the tokens after it are dropped)."""
        return self._call("POST", f"/v1/sessions/{sid}/rewind", _json, json={"position": position})

    def delete(self, sid: str) -> None:
        return self._call("DELETE", f"/v1/sessions/{sid}", _nothing)

    # OpenAI-compatible and system. `return_state=True` (or "blob") asks for the state after the
    # answer (the answer's "state"); `state=` goes on from one: a returned state object (its blob
    # where it has one, else its snapshot id), a snapshot id, or {"blob": ...}
    def completions(self, **body) -> dict:
        return self._call("POST", "/v1/completions", _json, json=_with_state(body))

    def chat(self, **body) -> dict:
        return self._call("POST", "/v1/chat/completions", _json, json=_with_state(body))

    def responses(self, **body) -> dict:
        return self._call("POST", "/v1/responses", _json, json=_with_state(body))

    def models(self) -> list[dict]:
        return self._call("GET", "/v1/models", _data)

    def decode_steps(self, within: float = 300.0) -> dict[str, str | None]:
        """Each served model's decode step (compiled | compiling | eager), once none is still
        compiling or `within` seconds have passed: a fresh server serves eagerly while its step
        compiles in the background, so a benchmark measures what it serves with after this."""
        deadline = time.monotonic() + within
        while True:
            steps = {m["id"]: m.get("decode_step") for m in self.models()}
            if "compiling" not in steps.values() or time.monotonic() >= deadline:
                return steps
            time.sleep(0.5)  # polling the server's own report: there is nothing to wait on here

    def health(self) -> dict:
        return self._call("GET", "/healthz", _json)

    def metrics(self) -> str:
        return self._call("GET", "/metrics", lambda r: r.text)


def state_field(state: str | dict) -> str | dict:
    """A request's `state` field for a state object an answer returned (or a snapshot id): its blob
    where it carries one (any replica can continue from it), else its snapshot id."""
    if isinstance(state, dict) and "blob" in state:
        return {"blob": state["blob"]}
    return state["snapshot_id"] if isinstance(state, dict) else state


def _with_state(body: dict) -> dict:
    return {**body, "state": state_field(body["state"])} if body.get("state") is not None else body


def _stream_body(max_tokens, temperature, top_p, top_k, seed, stop, logprobs) -> dict:
    return {**_sampling(max_tokens, temperature, top_p, top_k, seed, stop, logprobs), "stream": True}


class Client(_Requests):
    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float | None = None):
        conf = _Conf.make(base_url, api_key, timeout)
        self.http = httpx.Client(base_url=conf.base_url, headers=conf.headers, timeout=conf.timeout)

    def close(self):
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def _req(self, method, path, **kw) -> httpx.Response:
        r = self.http.request(method, path, **kw)
        _raise(r)
        return r

    def _call(self, method, path, read, **kw):
        return read(self._req(method, path, **kw))

    def generate(self, sid: str, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: list[str] | None = None, logprobs: int | None = None) -> GenerationStream:
        body = _stream_body(max_tokens, temperature, top_p, top_k, seed, stop, logprobs)

        def it():
            with connect_sse(self.http, "POST", f"/v1/sessions/{sid}/generate", json=body) as es:
                if es.response.status_code >= 400:
                    es.response.read()
                    _raise(es.response)
                for e in es.iter_sse():
                    if not e.data:  # a keep-alive comment (see _event)
                        continue
                    if e.data == "[DONE]":
                        return
                    yield _event(e.event, e.data)
        return GenerationStream(it())


class AsyncClient(_Requests):
    """The same API with `await` (every method returns an awaitable); `generate` is an async
    iterator of TokenEvent and finally Done."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float | None = None,
                 limits: httpx.Limits | None = None):
        conf = _Conf.make(base_url, api_key, timeout)
        self.http = httpx.AsyncClient(base_url=conf.base_url, headers=conf.headers, timeout=conf.timeout,
                                      limits=limits or httpx.Limits(max_connections=1024, max_keepalive_connections=1024))

    async def aclose(self):
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *a):
        await self.aclose()

    async def _req(self, method, path, **kw) -> httpx.Response:
        r = await self.http.request(method, path, **kw)
        _raise(r)
        return r

    async def _call(self, method, path, read, **kw):
        return read(await self._req(method, path, **kw))

    async def generate(self, sid, max_tokens=64, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=None,
                       logprobs=None) -> AsyncIterator[TokenEvent | Done]:
        body = _stream_body(max_tokens, temperature, top_p, top_k, seed, stop, logprobs)
        async with aconnect_sse(self.http, "POST", f"/v1/sessions/{sid}/generate", json=body) as es:
            if es.response.status_code >= 400:
                await es.response.aread()
                _raise(es.response)
            async for e in es.aiter_sse():
                if not e.data:  # a keep-alive comment (see _event)
                    continue
                if e.data == "[DONE]":
                    return
                yield _event(e.event, e.data)
