"""API keys: `Authorization: Bearer KEY`, checked in constant time against every configured key.

A session or snapshot belongs to the key that made it (its `owner`, a hash of the key, never the
key itself); any other key is told 404, exactly as for an id that does not exist.
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from .errors import APIError


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def load_keys(keys: list[str], key_file: Path | None) -> list[str]:
    out = [k for k in keys if k]
    if key_file:
        out += [ln.strip() for ln in Path(key_file).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return out


class Keys:
    def __init__(self, keys: list[str]):
        self.keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def owner(self, authorization: str | None) -> str:
        """The caller's owner id ("" when keys are off); 401 unless a configured key is given."""
        if not self.keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        ok = False
        for k in self.keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(k, given)
        if scheme.lower() != "bearer" or not ok:
            raise APIError(401, "unauthorized", "a valid API key is required: Authorization: Bearer KEY",
                           headers={"WWW-Authenticate": "Bearer"})
        return key_id(given.decode())


async def caller(request: Request) -> str:  # async: a sync dependency costs a worker-thread hop per request
    return request.app.state.runtime.keys.owner(request.headers.get("authorization"))


Owner = Annotated[str, Depends(caller)]
