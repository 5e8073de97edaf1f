"""Request bodies (pydantic). Response shapes are documented in README.md's API section."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None


class Push(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    tokens: list[int] | None = None


class Sampling(BaseModel):
    max_tokens: int = Field(64, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None


class Generate(Sampling):
    model_config = ConfigDict(extra="forbid")
    stream: bool = True
    logprobs: int | None = Field(None, ge=0, le=20)


class Restore(BaseModel):
    model_config = ConfigDict(extra="forbid")
    snapshot_id: str
    model: str | None = None
