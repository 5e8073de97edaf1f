"""Server settings: one pydantic-settings class; environment LINSTREAM_*, overridden by the CLI."""
from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from linstream.model import WEIGHTS
from linstream.model.hub import check_name, is_repo_id
from linstream.model.hub import resolve as resolve_hub


# A list setting from the environment: comma-separated (LINSTREAM_MODELS=linear,mamba) or a JSON
# list of strings (LINSTREAM_MODELS='["linear","mamba"]', for a value that holds a comma)
Names = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LINSTREAM_")

    host: str = "127.0.0.1"
    port: int = 8000
    # model names (directories under model/weights) or checkpoint paths; the first is the default
    models: Names = Field(default_factory=lambda: ["linear"])
    # the API's names for those models, in order; a model without one is named after its directory
    names: Names = Field(default_factory=list)
    device: str = "cpu"  # cpu | cuda | cuda:N: where weights and session states live
    # on a CUDA device, the whole model's dtype: float32 | bfloat16 | float16 (the latter two for
    # Mamba, RWKV-4 and fla models). On the CPU another spelling of `weights`
    dtype: str = "float32"
    # the projections' format on the CPU (model/hf.py, model/compiled/lowp.py): auto (as the
    # checkpoint stores them), float32, bfloat16, float16 or int8 (weight-only); everything else,
    # and the session states, float32. A batch-1 decode step streams the projections' bytes
    weights: Literal["auto", "float32", "bfloat16", "float16", "int8"] = "auto"
    # keep each checkpoint's converted / packed projections in the compile cache's weights/ folder
    # (model/weight_cache.py), mapped at later starts instead of converted again
    weight_cache: bool = True
    # a chat template file (Jinja, or a tokenizer_config.json) used instead of each checkpoint's own
    chat_template: Path | None = None
    max_sessions: int = 1024  # recurrent models: sessions held in memory (state slots)
    # recurrent models: the bytes a model's slot pool may hold, so the slots are at most this over
    # one session's state (a 1.4 B Mamba's state is 15 MB: 1,024 slots would be 15 GiB, made at
    # start-up); sessions past the slots wait in the store, as past max_sessions
    max_state_bytes: int = Field(2 << 30, gt=0)
    max_kv_sessions: int = 4  # KV-cache models: every slot's cache grows to the longest context held
    # KV-cache models (softmax, hybrid): the cache bytes one session may hold (a push or generation
    # that would pass it: 413 kv_budget_exceeded), and that a model's slot pool may hold; every
    # slot's cache is as long as the longest held, so this bounds slots x the longest context (past
    # it: 507 kv_memory_full). Caches shrink again when their longest session is deleted
    kv_session_bytes: int = Field(256 << 20, gt=0)
    kv_total_bytes: int = Field(2 << 30, gt=0)
    max_prompt_tokens: int = 65536  # per create/push/completion request
    # prompt text per request, checked before tokenizing; 0 = 16 bytes per max_prompt_tokens
    max_prompt_bytes: int = 0
    max_new_tokens: int = 4096  # per generate request
    # tokens a session's history may hold (a push or generation that would pass it: 413
    # history_too_long); state blobs carry it whole, so the restore limit grows to fit the largest
    # blob a session can download (Runtime.blob_limit), whatever max_body_bytes says
    max_history_tokens: int = Field(1 << 22, gt=0)
    # constrained decoding (server/runtime/constraints.py): a schema's or grammar's text is at most
    # grammar_max_bytes, and compiled within grammar_timeout_s seconds, else the request gets a 400
    grammar_max_bytes: int = Field(1 << 16, ge=1)
    grammar_timeout_s: float = Field(5.0, gt=0)
    max_body_bytes: int = 16 << 20  # state blobs (application/octet-stream); raised to fit max_history_tokens
    # JSON bodies, parsed whole on the event loop; 0 = room for a prompt of max_prompt_bytes with
    # every byte escaped to 3 (any text but control characters written \u00XX) or for
    # max_prompt_tokens ids of up to 10 digits ("2147483647, "), whichever is more, plus 64 KiB for other fields,
    # plus a state blob of state_blob_bytes in base64
    max_json_bytes: int = 0
    prefill_chunk: int = 512  # prefill tokens per slice when no generation is running
    # while generations run, a prefill slice is sized (by measured costs) to take about this
    # fraction of a decode step, never under engine.MIN_SLICE tokens; 0 = whole prefill_chunk slices
    prefill_share: float = Field(0.5, ge=0)
    max_batch: int = 256  # sessions advanced by one decode step
    # while two or more API keys have work on a model, a decode step carries a budget of rows (at
    # least one per key, the keys taking turns) kept so that a lone stream's gap between tokens is
    # about this many one-row iterations (measured): one key's many streams slow another's little,
    # at the cost of their own tokens/s; 0 = rows shared by key only past max_batch
    fair_step_cost: float = Field(3.0, ge=0)
    max_queue: int = 256  # generations waiting beyond max_batch; more are refused with 503
    max_streams_per_key: int = 0  # concurrent generations per API key (0 = unlimited)
    # an OpenAI request's choices (prompts x n or best_of) generating side by side, each on its
    # own session; the others wait for one to end
    choices_at_once: int = Field(16, ge=1)
    tokens_per_minute_per_key: int = 0  # generated tokens per key per minute (0 = unlimited)
    stream_send_timeout: float = 30.0  # seconds a client may leave one SSE event unread
    sse_ping_s: float = Field(5.0, ge=0)  # seconds between keep-alive comments on SSE streams (0 = none)
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
    # its new part (sessions/prefix_cache.py); a byte budget over all models, LRU; 0 = off
    prefix_cache_bytes: int = 256 << 20
    prefix_cache_shared: bool = False  # one cache for every API key (single tenant); else one per key
    # torch intra-op threads; 0 = auto: one fewer than the CPUs this process may run on, at least
    # one (the event loop keeps a core: see server/engine/loading.py)
    threads: int = Field(default=0, ge=0)
    # decode step: auto = compiled (inductor) once warm, eager meanwhile and without a C++ compiler;
    # on = the same but a missing compiler is an error; off = eager only (model/compiled/stepper.py)
    compile: Literal["auto", "on", "off"] = "auto"
    # the compiled step's float32 projections (model/compiled/gemm.py): own = our AVX-512 / AVX2
    # kernel (model/kernels), as fast as inductor's template at one row and much faster at large
    # batches (inductor's where the CPU has neither; it also runs --weights bfloat16's projections);
    # inductor = its own GEMM template; onednn = oneDNN's matmul, faster than the template at large
    # batches, slower for one (float32 weights only). Each keeps a row's tokens independent of the load
    gemm: Literal["own", "inductor", "onednn"] = "own"
    # how the compiled step is called: aoti = built ahead of time by AOTInductor into a library
    # called with the GIL released (model/compiled/aot.py; built once, kept in the compile cache), falling
    # back to dynamo where that build fails; dynamo = torch.compile's function
    step_runtime: Literal["aoti", "dynamo"] = "aoti"
    # where snapshots and every session's latest state live: memory, disk:PATH or redis://HOST:PORT/DB
    store: str = Field(default_factory=lambda: "disk:" + str(Path.home() / ".cache" / "linstream" / "store"))
    # disk store: changes are refused (503) while fewer bytes than this are free on its file system
    store_min_free: int = 4 << 20
    replica_lease: float = 10.0  # with a Redis store: seconds a replica's hold on a session outlives it
    # with a Redis store: this replica's name, sent as the X-Linstream-Replica header and in 409
    # session_owned_elsewhere (default hostname:port), and the URL the other replicas reach it at,
    # to tell a dead lease holder from a live one (default http://host:port, the hostname where
    # host is a wildcard address); see sessions/leases.py
    replica_name: str = ""
    replica_url: str = ""
    # seconds a replica stays registered as alive in Redis without renewing (a heartbeat thread
    # renews it four times as often): a holder whose registration lapsed is dead to the others
    replica_alive_s: float = Field(3.0, gt=0)
    # on SIGTERM: seconds /health answers 503 while every request is still served, so that a proxy
    # or an orchestrator moves traffic away before the listener closes (0 = close at once)
    drain_notice_s: float = Field(0.0, ge=0)
    # with a Redis store: prefix-cache entries are also written to Redis (sessions/prefix_tier.py),
    # so that a conversation's next turn starts from its prefix on any replica; a byte budget over
    # all of them (oldest written first out; 0 = off), each expiring prefix_tier_ttl seconds after
    # its last use; prefix_tier_url: another Redis for them (default: the store's)
    prefix_tier_bytes: int = Field(1 << 30, ge=0)
    prefix_tier_ttl: float = Field(600.0, gt=0)
    prefix_tier_url: str = ""
    session_ttl: float = 0.0  # seconds idle before a session expires (0 = never)
    snapshot_ttl: float = 0.0  # seconds a snapshot is kept (0 = until deleted with the store)
    # per-key quotas (sessions/quotas.py; 429 quota_exceeded past them, 0 = none): sessions and
    # stored responses together, and snapshot bytes; unset: 1,000 and 4 GiB with API keys, none without
    quota_sessions: int | None = Field(None, ge=0)
    quota_snapshot_bytes: int | None = Field(None, ge=0)
    # state in the client's hands (docs/api.md#client-held-state): a state returned by an OpenAI
    # route is kept as a snapshot this many seconds (0 = as snapshot_ttl), and a state blob returned
    # or sent there is at most state_blob_bytes (400 naming the limit past it): the shipped models'
    # 176 KiB state with 40,000 tokens of history; a larger state is handed back by snapshot id
    state_ttl: float = Field(3600.0, ge=0)
    state_blob_bytes: int = Field(512 << 10, gt=0)
    # rewind: a session keeps a copy of its state every checkpoint_every tokens (0 = none), at most
    # checkpoint_bytes of them per session (the oldest go first), in memory and in the store
    checkpoint_every: int = Field(256, ge=0)
    checkpoint_bytes: int = Field(8 << 20, ge=0)
    api_keys: Names = Field(default_factory=list)  # when set, every route but /healthz needs one
    api_key_file: Path | None = None  # one key per line; '#' starts a comment
    metrics_public: bool = False  # serve /metrics without a key
    # the operator's key for /metrics, which tells of every tenant's work; no API key opens it.
    # Unset while api_keys are set: /metrics is refused (403), unless metrics_public
    metrics_key: str = ""
    docs_public: bool = False  # serve /docs, /redoc and /openapi.json without a key
    # browser pages on these origins may call the API (CORS; "*" for any); none by default
    allowed_origins: Names = Field(default_factory=list)
    log_format: Literal["text", "json"] = "text"  # json: one object per line (server/core/logs.py)
    access_log: bool = True  # uvicorn's line per request

    @field_validator("models", "names", "api_keys", "allowed_origins", mode="before")
    @classmethod
    def _listed(cls, v: object) -> object:
        """A list as the environment spells it: JSON, or comma-separated (blanks dropped)."""
        if not isinstance(v, str):
            return v
        if v.lstrip().startswith("["):
            try:
                listed = json.loads(v)
            except ValueError:
                raise ValueError("not a JSON list; give a comma-separated list or a JSON list of strings") from None
            if not all(isinstance(x, str) for x in listed):
                raise ValueError("give a comma-separated list or a JSON list of strings")
            return listed
        return [x.strip() for x in v.split(",") if x.strip()]

    @model_validator(mode="after")
    def _derived(self) -> "Settings":
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device {self.device!r}: use cpu, cuda or cuda:N")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: use float32, bfloat16 or float16")
        if self.device == "cpu" and self.dtype != "float32":  # --dtype on the CPU: the projections' format
            if self.weights not in ("auto", self.dtype):
                raise ValueError(f"--dtype {self.dtype} and --weights {self.weights}: on the CPU both name the "
                                 "projections' format; give --weights only")
            self.weights = "bfloat16" if self.dtype == "bfloat16" else "float16"  # the two dtypes left here
            self.dtype = "float32"
        if self.weights not in ("auto", "float32") and (self.device, self.dtype) != ("cpu", "float32"):
            raise ValueError(f"{self.weights} weights need device cpu; on a GPU --dtype sets the whole model's")
        if self.gemm == "onednn" and self.weights == "auto":
            self.weights = "float32"
        if self.gemm == "onednn" and (self.device, self.dtype, self.weights) != ("cpu", "float32", "float32"):
            raise ValueError("--gemm onednn needs device cpu, dtype float32 and float32 weights")
        if len(self.names) > len(self.models):
            raise ValueError(f"{len(self.names)} names for {len(self.models)} models")
        if not self.replica_name:
            self.replica_name = f"{socket.gethostname()}:{self.port}"
        if not self.replica_url:
            host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
            self.replica_url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        if not self.max_prompt_bytes:
            self.max_prompt_bytes = 16 * self.max_prompt_tokens
        if not self.max_json_bytes:
            self.max_json_bytes = min(self.max_body_bytes,  # and a state blob in base64 (`state`)
                                      max(3 * self.max_prompt_bytes, 12 * self.max_prompt_tokens) + (64 << 10)
                                      + 4 * self.state_blob_bytes // 3)
        return self

    def checkpoint(self, name: str) -> Path:
        """A directory, else a shipped model's, else `org/name` from the Hugging Face cache
        (model/hub.py: the cache only, never the network; CheckpointError where it is not there)."""
        check_name(name)  # one no file system or hub takes is refused before any path is tried
        p = Path(name)
        if p.is_dir() or (WEIGHTS / name).is_dir() or not is_repo_id(name):
            return p if p.is_dir() else WEIGHTS / name
        return resolve_hub(name)


def bad_settings(e: ValidationError | SettingsError, given: dict) -> str:
    """What is wrong with the settings, in one line naming each option or variable at fault:
    `given` holds the options set on the command line; the rest came from the environment."""
    if isinstance(e, SettingsError):
        return str(e)
    out = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a check across settings (_derived): its message names them
            out.append(msg)
            continue
        name = str(err["loc"][0])
        where = f"--{name.replace('_', '-')}" if name in given else f"LINSTREAM_{name.upper()}"
        value = None if "key" in name else given.get(name, err.get("input"))  # never a key in the log
        out.append(f"{where}={value!r}: {msg}" if isinstance(value, (str, int, float)) else f"{where}: {msg}")
    return "; ".join(out)
