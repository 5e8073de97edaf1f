"""Stored responses (/v1/responses) in the session store: one record `resp/<id>` per response,
holding the response as the client was given it, its owner, and the session that holds the state
its generation ended in (the state a response naming it as `previous_response_id` goes on from).

The record sits in the same store as the sessions (memory, disk or Redis), so a stored response
follows them across restarts and replicas; its session is an ordinary one (spilled, reloaded and
leased like any other). Someone else's response is reported exactly like a missing one.
"""
from __future__ import annotations

from ..core.errors import APIError, not_found
from .session import decode_record, encode_record, new_id
from .store import Store, StoreError


def new_response_id() -> str:
    return new_id("resp")


class ResponseRecords:
    def __init__(self, store: Store, ttl: float = 0.0):
        self.store, self.ttl = store, ttl or None  # expiring with the sessions (session_ttl) when they do

    async def put(self, rid: str, owner: str, session: str, response: dict) -> None:
        meta = {"kind": "response", "id": rid, "owner": owner, "session": session, "response": response}
        await self.store.put(f"resp/{rid}", encode_record(meta, b""), self.ttl)

    async def get(self, rid: str, owner: str, param: str | None = None) -> dict:
        """The record's metadata: {"session", "response", ...}. 404 (naming `param`, the field
        that gave the id) when there is none or it is another key's."""
        try:
            rec = await self.store.get(f"resp/{rid}")
        except ValueError:  # not a well-formed id: cannot exist
            rec = None
        except StoreError as e:
            raise APIError(500, "store_damaged", f"response {rid!r} is damaged: {e}") from None
        meta = decode_record(rec)[0] if rec else None
        if meta is None or meta.get("owner") != owner:
            raise not_found("response", rid, param)
        return meta

    async def forget(self, rid: str) -> None:
        await self.store.delete(f"resp/{rid}")
