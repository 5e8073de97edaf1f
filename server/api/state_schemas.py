"""Request fields for state in the client's hands: a session's rewind and fork at a position, and
the OpenAI routes' `return_state` / `state` (docs/api.md#client-held-state)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .schemas import Body, ResponseBody

MAX_POSITION = 2 ** 40  # as a state blob's (model/snapshot.py)


class Rewind(Body):
    model_config = ConfigDict(extra="forbid")
    position: int = Field(ge=0, le=MAX_POSITION)


class Fork(Body):
    model_config = ConfigDict(extra="forbid")
    position: int | None = Field(None, ge=0, le=MAX_POSITION)  # None: the session's position


class StateBlob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    blob: str  # the state blob, base64-encoded


class StateFields(BaseModel):
    """The OpenAI routes' extension fields: `return_state` asks for the state after the last token
    returned (true: kept in the store, named by its snapshot id; "blob": the blob too), `state`
    continues from one (a snapshot id, or {"blob"})."""
    return_state: bool | Literal["blob"] = False
    state: str | StateBlob | None = None


class ReturnedState(ResponseBody):
    """An answer's `state` (return_state): the state after its last token."""
    snapshot_id: str = Field(description="kept in the store under the caller's key for state_ttl seconds")
    position: int
    bytes: int = Field(description="the state blob's size")
    model: str
    blob: str | None = Field(None, description='the state blob, base64 (return_state: "blob")')
