"""API keys: `Authorization: Bearer KEY`, checked in constant time against every configured key.

/metrics, which counts every tenant's work, takes an operator key of its own (`Keys.operator`).
A missing or wrong key is 401 with type "unauthorized" and OpenAI's code for it, "invalid_api_key".

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
                           headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
        return key_id(given.decode())

    def operator(self, authorization: str | None, key: str) -> None:
        """For /metrics, which tells of every tenant's work: the operator's `key` (settings.metrics_key),
        never a tenant's. Open when neither is set; 403 when tenants' keys are set and no operator key."""
        if not key:
            if self.keys:
                raise APIError(403, "forbidden", "/metrics tells of every key's work: it needs the operator's key, "
                               "and none is set (serve --metrics-key, LINSTREAM_METRICS_KEY); see /v1/usage for your own")
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.encode(), token.strip().encode()):
            raise APIError(401, "unauthorized", "/metrics needs the operator's key: Authorization: Bearer KEY",
                           headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")


async def caller(request: Request) -> str:  # async: a sync dependency costs a worker-thread hop per request
    return request.app.state.runtime.keys.owner(request.headers.get("authorization"))


Owner = Annotated[str, Depends(caller)]
