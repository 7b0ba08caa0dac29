"""Settings: every variable, its flag, default and check, in one table.

The names, defaults and meanings are those of the Rust lpcache, so a deployment can switch without changing a
line. A value comes from its command-line flag, else its environment variable, else the default. Each value is
checked once, here; a bad one raises `ConfigError` naming the variable, and start-up stops with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

from .errors import ConfigError

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
    coalesce_requests: bool = False
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

def _int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{value} is below the minimum of {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{value} is above the maximum of {maximum}")
        return value
    return parse


def _float(minimum: float, maximum: float | None = None, *, exclusive_min: bool = False) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
        if value != value or (exclusive_min and value <= minimum) or value < minimum:
            raise ValueError(f"{raw.strip()} must be {'above' if exclusive_min else 'at least'} {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{raw.strip()} must be at most {maximum}")
        return value
    return parse


def _text(raw: str) -> str:
    return raw


def _optional_text(raw: str) -> str | None:
    return raw.strip() or None


def _url(raw: str) -> str:
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{raw!r} is not an http(s) URL")
    return url


def shown_url(url: str | None) -> str | None:
    """A URL for a log line: its password (redis://:secret@host, http://user:secret@host) replaced by ***."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _redis_url(raw: str) -> str | None:
    url = raw.strip()
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix") or not (parts.netloc or parts.path):
        raise ValueError(f"{raw!r} is not a redis://, rediss:// or unix:// URL")
    return url


_REPLICA = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _replica_id(raw: str) -> str | None:
    name = raw.strip()
    if not name:
        return None
    if not _REPLICA.fullmatch(name):
        raise ValueError(f"{raw!r} is not one word of letters, digits, '.', '_' or '-' (64 at most)")
    return name


def default_replica_id() -> str:
    """<hostname>-<pid>, made one word: unique among replicas on several hosts and several on one host."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48] or "lpcache"
    return f"{host}-{os.getpid()}"


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{raw!r} is not one of {', '.join(LOG_LEVELS)}")
    return {"TRACE": "DEBUG", "WARN": "WARNING"}.get(level, level)


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not true or false")


def _keys(raw: str) -> tuple[str, ...]:
    """A comma-separated list of keys, or @FILE with one key per line (blank lines and # comments skipped)."""
    raw = raw.strip()
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as e:
            raise ValueError(f"cannot read the key file {raw[1:]!r}: {e.strerror}") from None
        keys = [line for line in lines if line and not line.startswith("#")]
    else:
        keys = [k.strip() for k in raw.split(",") if k.strip()]
    if raw and not keys:
        raise ValueError("no key in it")
    return tuple(keys)


def _plugin_specs(raw: str) -> tuple[dict[str, Any], ...]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError('must be a JSON array of {"name": ..., "params": {...}} objects')
    specs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f'entry {i} is not an object with a "name" string')
        params = item.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f'entry {i} ({item["name"]}): "params" must be an object')
        specs.append({"name": item["name"], "params": params})
    return tuple(specs)


def _fields(raw: str) -> tuple[str, ...]:
    fields = tuple(f.strip() for f in raw.split(",") if f.strip())
    if not fields:
        raise ValueError("no field named")
    return fields


def _backends(raw: str) -> tuple[BackendConfig, ...]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError("must be a non-empty JSON array of objects with a \"url\"")
    backends = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"entry {i} is not an object")
        if not isinstance(item.get("url"), str):
            raise ValueError(f"entry {i} has no \"url\" string")
        url = _url(item["url"])
        n_slots = item.get("n_slots")
        if n_slots is not None and (isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1):
            raise ValueError(f"entry {i}: \"n_slots\" must be an integer of at least 1")
        path = item.get("slot_save_path")
        if path is not None and not isinstance(path, str):
            raise ValueError(f"entry {i}: \"slot_save_path\" must be a string")
        kv_cache = item.get("kv_cache", True)
        if not isinstance(kv_cache, bool):
            raise ValueError(f"entry {i}: \"kv_cache\" must be true or false")
        client = item.get("client", "llama")
        if not isinstance(client, str) or not client:
            raise ValueError(f"entry {i}: \"client\" must be the name of a backend-client plugin")
        router = item.get("router")
        if router is not None and not isinstance(router, bool):
            raise ValueError(f"entry {i}: \"router\" must be true or false")
        backends.append(BackendConfig(url, n_slots, path or None, kv_cache, client, router,
                                      _count(item, "max_files", i), _gib(item, i), _count(item, "models_max", i)))
    return tuple(backends)


def _count(item: Mapping[str, Any], name: str, i: int) -> int | None:
    value = item.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"entry {i}: \"{name}\" must be an integer of at least 0")
    return value


def _gib(item: Mapping[str, Any], i: int) -> float | None:
    value = item.get("max_gib")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0):
        raise ValueError(f"entry {i}: \"max_gib\" must be a number of at least 0")
    return None if value is None else float(value)


def _words_or_auto(raw: str) -> int | None:
    """A word count, or `auto` (None: the cost-based policy of `worth`)."""
    if raw.strip().lower() == "auto":
        return None
    try:
        return _int(0)(raw)
    except ValueError as e:
        raise ValueError(f"{e}, nor auto") from None


def _gib_or_auto(raw: str) -> float | None:
    """A size in GiB (0 = no limit), or `auto` (None: derived from the disk at start)."""
    if raw.strip().lower() == "auto":
        return None
    return _float(0.0)(raw)


def _save_policy(raw: str) -> str:
    value = raw.strip().lower()
    if value not in SAVE_POLICIES:
        raise ValueError(f"{raw!r} is not one of {', '.join(SAVE_POLICIES)}")
    return value


@dataclass(frozen=True)
class Option:
    """One setting: its variable, flag, parser, default (as text, as a user would write it) and help."""

    env: str
    flag: str
    parse: Callable[[str], Any]
    default: str | None
    help: str
    metavar: str = "VALUE"


OPTIONS: tuple[Option, ...] = (
    Option("BACKENDS", "--backends", _backends, None,
           'JSON array of backends: [{"url": "...", "n_slots": N, "slot_save_path": "...", "kv_cache": true}]. '
           "n_slots defaults to the server's total_slots (GET /props); kv_cache false turns off save and restore "
           "for that backend. Optional too: \"router\" (true/false; unset: asked from GET /props), \"max_files\", "
           "\"max_gib\", \"models_max\" (this backend's MAX_FILES, MAX_GIB, MODELS_MAX). When unset, one backend "
           "is built from LLAMA_URL, N_SLOTS and SLOT_SAVE_PATH.",
           metavar="JSON"),
    Option("LLAMA_URL", "--llama-url", _url, "http://127.0.0.1:8000",
           "The single backend's URL when BACKENDS is unset.", metavar="URL"),
    Option("N_SLOTS", "--n-slots", _int(1), "1",
           "Slot count of the LLAMA_URL backend when set explicitly; otherwise the server's total_slots is used, "
           "and this default only when the server cannot be asked.", metavar="N"),
    Option("WORDS_PER_BLOCK", "--words-per-block", _int(1), "100", "Words per hash block.", metavar="N"),
    Option("BIG_THRESHOLD_WORDS", "--big-threshold-words", _words_or_auto, "500",
           "A request with more words than this is big: its KV cache is saved after completion and restored "
           "before a later request that shares its prefix. auto: no word count; a cache is saved when the "
           "prefill it can spare, weighed by how often a later request needs a file, beats writing and reading "
           "it, at the prefill, save and restore speeds lpcache measures on each backend and model (short chat "
           "turns on a CPU or an Apple chip are saved, nothing on a fast GPU); META_MAX is then not counted "
           "unless set (META_MAX_GIB's bytes bound the files).", metavar="N|auto"),
    Option("LCP_TH", "--lcp-th", _float(0.0, 1.0), "0.1",
           "Minimum share of the request's blocks that a saved cache must match, from the start, to be restored "
           "(0..1).", metavar="RATIO"),
    Option("META_DIR", "--meta-dir", _text, "./kv_meta", "Folder of the <key>.meta.json files.", metavar="DIR"),
    Option("META_MAX", "--meta-max", _int(0), "10",
           "Most meta files kept, with their KV files; 0 = no limit (with BIG_THRESHOLD_WORDS=auto, unset means no "
           "limit). First deleted: files a later turn moved on from, "
           "then those an idle slot holds (saved again before it is replaced; not with REDIS_URL, where another "
           "replica may replace the slot), then those needed furthest in the future. A file chosen for a restore "
           "not run yet is neither deleted nor counted.",
           metavar="N"),
    Option("META_MAX_GIB", "--meta-max-gib", _gib_or_auto, "auto",
           "Most GiB of prefix-mode cache files kept (besides META_MAX), the ones least likely to be used again "
           "deleted first; 0 = no limit. auto: a quarter of the space free on the disk of the first visible "
           "slot-save folder at start, plus what the caches already use (no limit when no folder is visible).",
           metavar="GIB"),
    Option("SLOT_SAVE_PATH", "--slot-save-path", _optional_text, None,
           "The backend's --slot-save-path folder as lpcache sees it (single-backend fallback); pruned KV files "
           "are deleted from it.", metavar="DIR"),
    Option("REQUEST_TIMEOUT", "--request-timeout", _float(0.0, exclusive_min=True), "600",
           "Seconds a request to a backend may take.", metavar="SECONDS"),
    Option("MODEL_ID", "--model-id", _text, "llama.cpp",
           "Model id advertised by /v1/models, and used for a request that names no model.", metavar="ID"),
    Option("HOST", "--host", _text, "0.0.0.0", "Address to listen on.", metavar="ADDR"),
    Option("PORT", "--port", _int(1, 65535), "8081", "Port to listen on.", metavar="PORT"),
    Option("LLAMA_API_KEY", "--api-key", _optional_text, None,
           "The key lpcache sends to llama-server (the one given to its --api-key), as Authorization: Bearer <KEY>; "
           "blank = none. Not the keys clients send to lpcache: those are LPCACHE_API_KEYS (--api-keys).",
           metavar="KEY"),
    Option("LOG_LEVEL", "--log-level", _log_level, "INFO",
           "Log level: DEBUG, INFO, WARNING, ERROR (TRACE and WARN are accepted; RUST_LOG, when a plain level, "
           "overrides it).", metavar="LEVEL"),
    Option("STREAM_QUEUE_SIZE", "--stream-queue-size", _int(1), "16",
           "Chunks buffered per streaming request between the backend reader and the client (at least 1).",
           metavar="N"),
    Option("SAVE_RETRIES", "--save-retries", _int(0), "3",
           "Retries after a failed KV cache save; 0 = no retry.", metavar="N"),
    Option("SAVE_RETRY_DELAY_MS", "--save-retry-delay-ms", _int(0), "1000",
           "Milliseconds between save retries.", metavar="MS"),
    Option("SLOT_WAIT_TIMEOUT", "--slot-wait-timeout", _float(0.0, exclusive_min=True), "300",
           "Seconds a request waits for a free slot before it gets 503 all slots busy.", metavar="SECONDS"),
    Option("SLOT_AFFINITY_WAIT", "--slot-affinity-wait", _float(0.0), "30",
           "Longest wait, in seconds, for a busy slot that will hold more of a request's prompt than any idle slot "
           "or saved cache (its conversation's previous turn, still answered or saved, or a request sharing its "
           "long prefix that came just before). lpcache waits only while "
           "the wait is expected to be shorter than the prefill it spares, from the speeds it learnt; 0 = never.",
           metavar="SECONDS"),
    Option("REDIS_URL", "--redis-url", _redis_url, None,
           "Several lpcache replicas in front of the same llama-servers share, through this Redis "
           "(redis://[:password@]host:port/db, rediss:// for TLS), the index of saved caches, what each slot holds, "
           "slot leases, sessions and learnt speeds (docs/scale-out.md). Unset: one process, nothing shared.",
           metavar="URL"),
    Option("REPLICA_ID", "--replica-id", _replica_id, None,
           "This replica's name in Redis: one word (letters, digits, . _ -). Unset: <hostname>-<pid>.",
           metavar="ID"),
    Option("SLOT_LEASE_MS", "--slot-lease-ms", _int(1000, 3_600_000), "15000",
           "With REDIS_URL: the expiry of a slot lease, renewed every third of it while held; a crashed replica's "
           "slots are free again within this.", metavar="MS"),
    Option("RING_FILES", "--ring-files", _int(1, 100_000), "32",
           "With REDIS_URL: for a backend whose slot-save folder lpcache cannot see (another host), prefix caches "
           "are saved under a ring of this many file names per backend, so a save overwrites the oldest: that "
           "backend's disk holds at most RING_FILES x its largest slot file.", metavar="N"),
    Option("CLIENT_SLOT_ACTIONS", "--client-slot-actions", _bool, "false",
           "Let clients send POST /slots/{id}?action=save|restore|erase through lpcache (refused with 403 "
           "otherwise: they would change slots behind lpcache's back). GET /slots is always passed on.",
           metavar="BOOL"),
    Option("COALESCE_REQUESTS", "--coalesce-requests", _bool, "false",
           "Concurrent identical generation requests (same route and body: prompt, model and generation "
           "parameters; same client key or Authorization, same X-Session-ID) share one backend call.",
           metavar="BOOL"),
    Option("LPCACHE_API_KEYS", "--api-keys", _keys, None,
           "Client keys: a comma-separated list, or @FILE with one key per line. When set, every request but "
           "GET /health needs Authorization: Bearer <key>, or X-Api-Key: <key> without an Authorization header "
           "(else 401). Not the key lpcache sends to llama-server: that is LLAMA_API_KEY (--api-key).",
           metavar="KEYS"),
    Option("MAX_BODY_BYTES", "--max-body-bytes", _int(1), "16777216",
           "Largest request body accepted, in bytes (413 above it). 16 MiB: a 128k-token prompt's text weighs about "
           "0.4 MB as JSON; the rest leaves room for about 20 images of 600 KB sent as data URLs.", metavar="BYTES"),
    Option("CLIENT_TIMEOUT", "--client-timeout", _float(0.0, exclusive_min=True), "30",
           "Seconds a client may take to send a request's head (from its connection, or from the end of the "
           "previous answer), and to send each next part of its body; a slower client gets 408 and its "
           "connection is closed.", metavar="SECONDS"),
    Option("BREAKER_COOLDOWN_MS", "--breaker-cooldown-ms", _int(1), "1000",
           "First cooldown of a backend whose breaker opened; it doubles with each failure in a row.", metavar="MS"),
    Option("BREAKER_MAX_COOLDOWN_MS", "--breaker-max-cooldown-ms", _int(1), "60000",
           "Longest cooldown of a failing backend.", metavar="MS"),
    Option("SHUTDOWN_TIMEOUT", "--shutdown-timeout", _float(0.0), "30",
           "Seconds requests in flight get to finish on SIGTERM/SIGINT (running saves get as long again, and with "
           "SAVE_POLICY=evict the final saves of unsaved slots as long once more).",
           metavar="SECONDS"),
    Option("SAVE_POLICY", "--save-policy", _save_policy, "eager",
           "When a slot's cache is written to disk. eager: after every big request (and a session's whenever it "
           "is swapped out changed), except when META_MAX is reached and the save could only make room by deleting "
           "the file of a cache an idle slot holds (which that slot would save again before it is replaced): then "
           "when its slot is needed or at shutdown, one write instead of two (not with REDIS_URL; a crash of lpcache "
           "or llama-server loses such a cache, as the deleted file would have been); evict: only when the slot is "
           "needed for another cache, after SAVE_IDLE_SECONDS without a request, and at shutdown.", metavar="POLICY"),
    Option("SAVE_IDLE_SECONDS", "--save-idle-seconds", _float(0.0), "0",
           "Also save a slot's unsaved cache once no request used it for this long (a request restarts the wait), "
           "unless META_MAX is reached and that save would only take the place of another idle slot's file; "
           "0 = never on idle.", metavar="SECONDS"),
    Option("MAX_FILES", "--max-files", _int(0), "0",
           "Keep at most this many saved session caches per route (model); the ones used longest ago go first. "
           "0 = no limit. Per backend: \"max_files\" in BACKENDS.", metavar="N"),
    Option("MAX_GIB", "--max-gib", _float(0.0), "0",
           "Keep at most this many GiB of saved session caches per route; 0 = no limit. Per backend: "
           "\"max_gib\" in BACKENDS.", metavar="GIB"),
    Option("MODELS_MAX", "--models-max", _int(0), "4",
           "The --models-max of a llama-server router (0 = no limit): the slots of the model it is about to "
           "unload are saved first. Per backend: \"models_max\" in BACKENDS.", metavar="N"),
    Option("PLUGINS", "--plugins", _plugin_specs, None,
           'JSON array of plugin specs [{"name": "...", "params": {...}}]. Built-ins: keyword, qwen_guard, '
           "result_cache, chain (prefilters, run in list order; [] = none), request_log, dashboard (at most one each); "
           "others come from installed packages (entry-point group lpcache.plugins). When set, the PREFILTER_* "
           "variables are ignored, and a request_log spec here wins over REQUEST_LOG*.", metavar="JSON"),
    Option("REQUEST_LOG", "--request-log", _bool, "false",
           "Append one W3C Extended Log Format record per finished request to REQUEST_LOG_PATH.", metavar="BOOL"),
    Option("REQUEST_LOG_PATH", "--request-log-path", _text, "lpcache-request.log",
           "Request-log file (relative to the working directory; its folder is created).", metavar="PATH"),
    Option("REQUEST_LOG_MAX_BYTES", "--request-log-max-bytes", _int(0), "10485760",
           "Rotate the request log past this size (<path>.1, <path>.2, ...); 0 = never.", metavar="BYTES"),
    Option("REQUEST_LOG_KEEP", "--request-log-keep", _int(0), "5",
           "Rotated request-log generations kept; 0 = all.", metavar="N"),
    Option("REQUEST_LOG_FIELDS", "--request-log-fields", _fields, None,
           "Comma-separated ordered subset of the request-log fields (default: all 28).", metavar="FIELDS"),
    Option("PREFILTER_BLOCKLIST", "--prefilter-blocklist", _optional_text, None,
           "Legacy (a keyword plugin when PLUGINS is unset): comma-separated keywords; a request whose messages "
           "contain one is rejected with 400.", metavar="WORDS"),
    Option("PREFILTER_CASE_INSENSITIVE", "--prefilter-case-insensitive", _bool, "true",
           "Legacy: keyword matching ignores case.", metavar="BOOL"),
    Option("PREFILTER_RESULT_CACHE_DIR", "--prefilter-result-cache-dir", _optional_text, None,
           "Legacy (a result_cache plugin when PLUGINS is unset): folder of cached results ({key}.json); a "
           "fresh same-key request is answered from it.", metavar="DIR"),
    Option("PREFILTER_RESULT_CACHE_TTL", "--prefilter-result-cache-ttl", _int(0), "300",
           "Legacy: seconds a cached result stays fresh; 0 = forever.", metavar="SECONDS"),
)

# `lpcache -h`'s examples (tests/unit/test_config.py loads each of them).
EXAMPLES = (
    ("one llama-server on this host, its slot files in ~/llama-slots",
     "lpcache --llama-url http://127.0.0.1:8080 --slot-save-path ~/llama-slots"),
    ("two servers, each with its own slot-save folder as lpcache sees it",
     """BACKENDS='[{"url": "http://gpu1:8080", "slot_save_path": "/mnt/slots1"}, """
     """{"url": "http://gpu2:8080", "slot_save_path": "/mnt/slots2"}]' lpcache"""),
    ("clients must send one of two keys; llama-server was started with --api-key server-key",
     "lpcache --api-keys alice-key,bob-key --api-key server-key --llama-url http://127.0.0.1:8080"),
    ("the dashboard at /dashboard, and a request log",
     """lpcache --plugins '[{"name": "dashboard"}]' --request-log --llama-url http://127.0.0.1:8080"""),
)


# (title, what the group is for, the variables in it, in the order shown)
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Core", "Where lpcache listens, what it logs, and how it decides which prompts to cache.",
     ("HOST", "PORT", "MODEL_ID", "LOG_LEVEL", "WORDS_PER_BLOCK", "BIG_THRESHOLD_WORDS", "LCP_TH", "META_DIR",
      "META_MAX", "META_MAX_GIB", "STREAM_QUEUE_SIZE", "COALESCE_REQUESTS")),
    ("Backends", "The llama-server instances behind lpcache, and how a failing one is treated.",
     ("BACKENDS", "LLAMA_URL", "N_SLOTS", "SLOT_SAVE_PATH", "LLAMA_API_KEY", "REQUEST_TIMEOUT",
      "BREAKER_COOLDOWN_MS", "BREAKER_MAX_COOLDOWN_MS")),
    ("Saving and sessions", "When a slot's cache is written to disk, and how many session files are kept "
     "(see [sessions.md](sessions.md)).",
     ("SAVE_RETRIES", "SAVE_RETRY_DELAY_MS", "SAVE_POLICY", "SAVE_IDLE_SECONDS", "MAX_FILES", "MAX_GIB",
      "MODELS_MAX")),
    ("Limits and hardening", "What a client may send and how long it may wait (see [operations.md](operations.md)).",
     ("SLOT_WAIT_TIMEOUT", "SLOT_AFFINITY_WAIT", "LPCACHE_API_KEYS", "CLIENT_SLOT_ACTIONS", "MAX_BODY_BYTES",
      "CLIENT_TIMEOUT", "SHUTDOWN_TIMEOUT")),
    ("Scale-out", "Several lpcache replicas sharing one cache map through Redis (see [scale-out.md](scale-out.md)).",
     ("REDIS_URL", "REPLICA_ID", "SLOT_LEASE_MS", "RING_FILES")),
    ("Plugins", "Prefilters, the request log and the dashboard (see [plugins.md](plugins.md)).",
     ("PLUGINS",)),
    ("Request log", "The built-in `request_log` plugin, switched on without writing a `PLUGINS` spec.",
     ("REQUEST_LOG", "REQUEST_LOG_PATH", "REQUEST_LOG_MAX_BYTES", "REQUEST_LOG_KEEP", "REQUEST_LOG_FIELDS")),
    ("Legacy prefilter variables", "Read only when `PLUGINS` is unset: they become a `keyword` and a "
     "`result_cache` plugin spec.",
     ("PREFILTER_BLOCKLIST", "PREFILTER_CASE_INSENSITIVE", "PREFILTER_RESULT_CACHE_DIR",
      "PREFILTER_RESULT_CACHE_TTL")),
)
OTHER_GROUP = ("Other settings", "Settings not sorted into a group yet.")


def grouped(options: Sequence[Option] = OPTIONS) -> list[tuple[str, str, list[Option]]]:
    """The options by group, each exactly once: GROUPS' order, then any option no group names."""
    by_env = {o.env: o for o in options}
    groups: list[tuple[str, str, list[Option]]] = []
    placed: set[str] = set()
    for title, intro, names in GROUPS:
        members = [by_env[n] for n in names if n in by_env and n not in placed]
        placed.update(o.env for o in members)
        if members:
            groups.append((title, intro, members))
    rest = [o for o in options if o.env not in placed]
    if rest:
        groups.append((*OTHER_GROUP, rest))
    return groups


def _plain_intro(text: str) -> str:
    """A group's intro from docs/configuration.md, for a terminal: links become the doc's path, no backticks."""
    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"docs/\2", text).replace("`", "")


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per option, help written next to the option above, in docs/configuration.md's groups."""
    from .version import __version__

    epilog = "examples:\n" + "\n".join(f"  {what}:\n    {line}" for what, line in EXAMPLES) + (
        "\n\nEvery setting, its meaning and default: docs/configuration.md (python -m lpcache.config_doc).")
    parser = argparse.ArgumentParser(
        prog="lpcache",
        usage="lpcache [-h] [-V] [--flag VALUE ...]",
        description="A KV-cache-aware, OpenAI-compatible proxy in front of llama.cpp llama-server instances. "
                    "Every flag has an environment variable of the name shown; flags win over the environment, "
                    "the environment over the defaults.",
        epilog=epilog,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"lpcache {__version__}")
    for title, intro, options in grouped(OPTIONS):
        group = parser.add_argument_group(title, _plain_intro(intro))
        for o in options:
            default = "unset" if o.default is None else o.default
            # A true/false option also works as a bare flag (--request-log), as in the Rust lpcache.
            bare: dict[str, Any] = {"nargs": "?", "const": "true"} if o.parse is _bool else {}
            group.add_argument(o.flag, dest=o.env, metavar=o.metavar, default=argparse.SUPPRESS,
                               help=f"{o.help} [env {o.env}, default {default}]", **bare)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """Wrapped help, but the epilog's example lines as written (a command is not reflowed)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return text
        return super()._fill_text(text, width, indent)


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve flags over environment over defaults, and check every value. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    flags = vars(build_parser().parse_args(argv if argv is not None else []))
    raw: dict[str, str | None] = {}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        if o.env in flags:
            raw[o.env], sources[o.env] = flags[o.env], "flag"
        elif o.env in environ:
            raw[o.env], sources[o.env] = environ[o.env], "env"
        else:
            raw[o.env], sources[o.env] = o.default, "default"
    if sources["LOG_LEVEL"] != "flag" and environ.get("RUST_LOG", "").strip().upper() in LOG_LEVELS:
        raw["LOG_LEVEL"], sources["LOG_LEVEL"] = environ["RUST_LOG"], "env"

    values: dict[str, Any] = {}
    for o in OPTIONS:
        text = raw[o.env]
        if text is None:
            values[o.env] = None
            continue
        try:
            values[o.env] = o.parse(text)
        except ValueError as e:
            raise ConfigError(o.env, str(e)) from None

    backends = values["BACKENDS"]
    if backends is None:
        explicit_slots = values["N_SLOTS"] if sources["N_SLOTS"] != "default" else None
        backends = (BackendConfig(values["LLAMA_URL"], explicit_slots, values["SLOT_SAVE_PATH"], True),)
    notes: list[str] = []
    backends = tuple(_api_root(b, notes, "BACKENDS" if values["BACKENDS"] is not None else "LLAMA_URL")
                     for b in backends)
    if values["BREAKER_MAX_COOLDOWN_MS"] < values["BREAKER_COOLDOWN_MS"]:
        raise ConfigError("BREAKER_MAX_COOLDOWN_MS", "must be at least BREAKER_COOLDOWN_MS")
    if not values["MODEL_ID"].strip():
        raise ConfigError("MODEL_ID", "must not be empty")

    return Settings(
        backends=backends,
        n_slots=values["N_SLOTS"],
        words_per_block=values["WORDS_PER_BLOCK"],
        big_threshold_words=values["BIG_THRESHOLD_WORDS"],
        lcp_th=values["LCP_TH"],
        meta_dir=values["META_DIR"],
        # auto keeps files by their value within META_MAX_GIB's bytes: a count of files is the wrong unit (kilobytes
        # for a small model, gigabytes for a large one), unless one is asked for
        meta_max=0 if values["BIG_THRESHOLD_WORDS"] is None and sources["META_MAX"] == "default"
        else values["META_MAX"],
        request_timeout=values["REQUEST_TIMEOUT"],
        model_id=values["MODEL_ID"],
        host=values["HOST"],
        port=values["PORT"],
        llama_api_key=values["LLAMA_API_KEY"],
        log_level=values["LOG_LEVEL"],
        stream_queue_size=values["STREAM_QUEUE_SIZE"],
        save_retries=values["SAVE_RETRIES"],
        save_retry_delay_ms=values["SAVE_RETRY_DELAY_MS"],
        slot_wait_timeout=values["SLOT_WAIT_TIMEOUT"],
        coalesce_requests=values["COALESCE_REQUESTS"],
        api_keys=values["LPCACHE_API_KEYS"] or (),
        max_body_bytes=values["MAX_BODY_BYTES"],
        client_timeout=values["CLIENT_TIMEOUT"],
        breaker_cooldown_ms=values["BREAKER_COOLDOWN_MS"],
        breaker_max_cooldown_ms=values["BREAKER_MAX_COOLDOWN_MS"],
        shutdown_timeout=values["SHUTDOWN_TIMEOUT"],
        save_policy=values["SAVE_POLICY"],
        save_idle_seconds=values["SAVE_IDLE_SECONDS"],
        max_files=values["MAX_FILES"],
        max_gib=values["MAX_GIB"],
        models_max=values["MODELS_MAX"],
        meta_max_gib=values["META_MAX_GIB"],
        slot_affinity_wait=values["SLOT_AFFINITY_WAIT"],
        client_slot_actions=values["CLIENT_SLOT_ACTIONS"],
        redis_url=values["REDIS_URL"],
        replica_id=values["REPLICA_ID"] or default_replica_id(),
        slot_lease_ms=values["SLOT_LEASE_MS"],
        ring_files=values["RING_FILES"],
        plugins=plugin_specs(values),
        sources=sources,
        notes=tuple(notes),
    )


def _api_root(backend: BackendConfig, notes: list[str], name: str) -> BackendConfig:
    """A backend URL given as an OpenAI base URL (ending in /v1, as clients are told to write it) is cut to the
    server's root: lpcache adds /v1/chat/completions, /props and /slots itself, and every request would 404."""
    if not backend.url.endswith("/v1"):
        return backend
    root = backend.url.removesuffix("/v1")
    notes.append(f"config_url_fixed {name}={shown_url(backend.url)} is used as {shown_url(root)}: lpcache needs "
                 f"llama-server's root URL (it adds /v1/... and /props itself)")
    return dataclasses.replace(backend, url=root)


def plugin_specs(values: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """PLUGINS as given, else the legacy PREFILTER_* variables as specs; then REQUEST_LOG* as a request_log spec
    unless one is listed already."""
    specs = list(values["PLUGINS"]) if values["PLUGINS"] is not None else []
    if values["PLUGINS"] is None:
        if values["PREFILTER_BLOCKLIST"]:
            specs.append({"name": "keyword", "params": {
                "keywords": [k.strip() for k in values["PREFILTER_BLOCKLIST"].split(",") if k.strip()],
                "case_insensitive": values["PREFILTER_CASE_INSENSITIVE"]}})
        if values["PREFILTER_RESULT_CACHE_DIR"]:
            specs.append({"name": "result_cache", "params": {
                "dir": values["PREFILTER_RESULT_CACHE_DIR"], "ttl_secs": values["PREFILTER_RESULT_CACHE_TTL"]}})
    if values["REDIS_URL"]:   # the replicas share one result cache, unless a spec names its own redis_url
        specs = [{**spec, "params": {**(spec.get("params") or {}), "redis_url": values["REDIS_URL"]}}
                 if spec.get("name") == "result_cache" and "redis_url" not in (spec.get("params") or {}) else spec
                 for spec in specs]
    if values["REQUEST_LOG"] and not any(spec["name"] == "request_log" for spec in specs):
        params: dict[str, Any] = {"path": values["REQUEST_LOG_PATH"], "max_bytes": values["REQUEST_LOG_MAX_BYTES"],
                                  "keep": values["REQUEST_LOG_KEEP"]}
        if values["REQUEST_LOG_FIELDS"]:
            params["fields"] = list(values["REQUEST_LOG_FIELDS"])
        specs.append({"name": "request_log", "params": params})
    return tuple(specs)


def describe(settings: Settings) -> str:
    """The settings for the start-up line, each once, keys hidden: not the backends and plugins (the line names
    them with their slot counts), nor N_SLOTS when it was not set (the servers' own counts are used)."""
    skipped = {"BACKENDS", "LLAMA_URL", "PLUGINS"}
    if settings.sources.get("N_SLOTS", "default") == "default":
        skipped.add("N_SLOTS")
    shown = []
    for o in OPTIONS:
        value: Any
        if o.env in skipped or o.env.startswith(("REQUEST_LOG", "PREFILTER_")):
            continue
        if o.env == "SLOT_SAVE_PATH":
            value = list(settings.slot_save_paths) or None
        elif o.env == "LLAMA_API_KEY":
            value = "set" if settings.llama_api_key else "unset"
        elif o.env == "REDIS_URL":
            value = shown_url(settings.redis_url)
        elif o.env == "META_MAX_GIB":
            value = "auto" if settings.meta_max_gib is None else settings.meta_max_gib
        elif o.env == "BIG_THRESHOLD_WORDS":
            value = "auto" if settings.big_threshold_words is None else settings.big_threshold_words
        elif o.env == "LPCACHE_API_KEYS":
            value = f"{len(settings.api_keys)} key(s)" if settings.api_keys else "unset"
        else:
            value = getattr(settings, o.env.lower(), None)
        shown.append(f"{o.env.lower()}={value}")
    return " ".join(shown)
