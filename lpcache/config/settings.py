"""Settings: every variable, its flag, default and check, in one table.

The names, defaults and meanings are those of the Rust lpcache, so a deployment can switch without changing a
line. A value comes from its command-line flag, else its environment variable, else the default. Each value is
checked once, here; a bad one raises `ConfigError` naming the variable, and start-up stops with status 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARN", "WARNING", "ERROR", "CRITICAL")
SAVE_POLICIES = ("eager", "evict")


@dataclass(frozen=True)
class BackendConfig:
    """One llama-server. `n_slots` None means: ask the server (`GET /props`, `total_slots`)."""

    url: str
    n_slots: int | None = None
    slot_save_path: str | None = None
    kv_cache: bool = True
    client: str = "llama"   # the backend-client plugin that talks to it
    router: bool | None = None       # a llama-server router (many models); None: ask GET /props (role)
    max_files: int | None = None     # per-route limits of saved session caches; None: MAX_FILES / MAX_GIB
    max_gib: float | None = None
    models_max: int | None = None    # the router's --models-max; None: MODELS_MAX


@dataclass(frozen=True)
class Settings:
    """The resolved configuration. Build it with `load_settings` (or directly in tests)."""

    backends: tuple[BackendConfig, ...] = (BackendConfig("http://127.0.0.1:8000"),)
    n_slots: int = 1
    words_per_block: int = 100
    big_threshold_words: int | None = 500   # None: auto (`worth`: saved when a file pays, from measured costs)
    lcp_th: float = 0.1
    meta_dir: str = "./kv_meta"
    meta_max: int = 10
    request_timeout: float = 600.0
    model_id: str = "llama.cpp"
    host: str = "0.0.0.0"
    port: int = 8081
    llama_api_key: str | None = None
    log_level: str = "INFO"
    stream_queue_size: int = 16
    save_retries: int = 3
    save_retry_delay_ms: int = 1000
    slot_wait_timeout: float = 300.0
    queue_max: int = 0
    client_priorities: tuple[tuple[str, str], ...] = ()   # (client key, class): `backends.admission`
    coalesce_requests: bool = False
    agent_session_ids: bool = True
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 16 * 1024 * 1024
    client_timeout: float = 30.0
    breaker_cooldown_ms: int = 1000
    breaker_max_cooldown_ms: int = 60000
    shutdown_timeout: float = 30.0
    save_policy: str = "eager"
    save_idle_seconds: float = 0.0
    max_files: int = 0
    max_gib: float = 0.0
    models_max: int = 4
    orphan_grace_seconds: float = 900.0    # files no meta file names are deleted after this (`cache.orphans`)
    tracing: str = "auto"                  # OpenTelemetry traces: auto (the OTEL_* variables say), on, off
    meta_max_gib: float | None = None      # None: auto (a share of the slot-save folder's disk, see `app`)
    slot_affinity_wait: float = 30.0
    client_slot_actions: bool = False
    redis_url: str | None = None           # several replicas share their cache map through Redis (`fleet`)
    replica_id: str = ""                   # this replica's name in Redis ("" : hostname-pid)
    slot_lease_ms: int = 15000
    ring_files: int = 32
    # Plugin specs ({"name", "params"}), in order: from PLUGINS, else translated from the legacy variables.
    plugins: tuple[dict[str, Any], ...] = ()
    # Where each value came from ("flag", "env" or "default"), for the start-up log and for N_SLOTS.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    # What loading the settings changed or found doubtful, one sentence each: logged as warnings at start.
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def slot_save_paths(self) -> tuple[str, ...]:
        """The slot-save folders lpcache knows of, for pruning KV files and checking stale meta files."""
        return tuple(dict.fromkeys(b.slot_save_path for b in self.backends if b.slot_save_path))


# ---- value parsers: each takes the raw string and returns the value or raises ValueError ----
