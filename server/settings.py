"""Server settings: one pydantic-settings class; environment LINSTREAM_*, overridden by the CLI."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

WEIGHTS = Path(__file__).resolve().parent.parent / "model" / "weights"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LINSTREAM_")

    host: str = "127.0.0.1"
    port: int = 8000
    # model names (directories under model/weights) or checkpoint paths; the first is the default
    models: list[str] = Field(default_factory=lambda: ["linear"])
    max_sessions: int = 1024  # recurrent models: sessions held in memory (state slots)
    max_kv_sessions: int = 4  # KV-cache models: every slot's cache grows to the longest context held
    max_prompt_tokens: int = 65536  # per create/push/completion request
    # prompt text per request, checked before tokenizing; 0 = 16 bytes per max_prompt_tokens
    max_prompt_bytes: int = 0
    max_new_tokens: int = 4096  # per generate request
    max_body_bytes: int = 16 << 20  # request bodies (state blobs included)
    prefill_chunk: int = 512  # prefill advances this many tokens between two decode steps
    max_batch: int = 256  # sessions advanced by one decode step
    max_queue: int = 256  # generations waiting beyond max_batch; more are refused with 503
    max_streams_per_key: int = 0  # concurrent generations per API key (0 = unlimited)
    tokens_per_minute_per_key: int = 0  # generated tokens per key per minute (0 = unlimited)
    stream_send_timeout: float = 30.0  # seconds a client may leave one SSE event unread
    # connections: a request's line and headers must arrive within header_timeout seconds of its
    # connection opening (or its previous response ending), its body within body_timeout of the
    # first read; an idle keep-alive connection closes after keep_alive_timeout; connections
    # beyond max_connections get 503 and are closed (the file-descriptor limit is raised to fit);
    # a request line and headers longer than max_header_bytes get 431
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024
    max_header_bytes: int = 64 << 10
    graceful_shutdown_s: int = 30  # on SIGTERM: stop accepting, let streams finish this long
    lookahead: bool = True  # step a token while its event is being sent (rolled back if it never arrives)
    # OpenAI requests: states kept where requests ended, so a re-sent conversation prefills only
    # its new part (prefix_cache.py); a byte budget over all models, LRU; 0 = off
    prefix_cache_bytes: int = 256 << 20
    prefix_cache_shared: bool = False  # one cache for every API key (single tenant); else one per key
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # where snapshots and every session's latest state live: memory, disk:PATH or redis://HOST:PORT/DB
    store: str = Field(default_factory=lambda: "disk:" + str(Path.home() / ".cache" / "linstream" / "store"))
    # disk store: changes are refused (503) while fewer bytes than this are free on its file system
    store_min_free: int = 4 << 20
    replica_lease: float = 10.0  # with a Redis store: seconds a replica's hold on a session outlives it
    session_ttl: float = 0.0  # seconds idle before a session expires (0 = never)
    snapshot_ttl: float = 0.0  # seconds a snapshot is kept (0 = until deleted with the store)
    api_keys: list[str] = Field(default_factory=list)  # when set, every route but /healthz needs one
    api_key_file: Path | None = None  # one key per line; '#' starts a comment
    metrics_public: bool = False  # serve /metrics without a key
    docs_public: bool = False  # serve /docs, /redoc and /openapi.json without a key

    @model_validator(mode="after")
    def _derived(self) -> "Settings":
        if not self.max_prompt_bytes:
            self.max_prompt_bytes = 16 * self.max_prompt_tokens
        return self

    def checkpoint(self, name: str) -> Path:
        p = Path(name)
        return p if p.is_dir() else WEIGHTS / name
