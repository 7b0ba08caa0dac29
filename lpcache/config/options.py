"""Every option: its variable, flag, default, check and help, in one table (`OPTIONS`), the value parsers,
and the groups docs/configuration.md and `-h` show them in."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from lpcache.config.settings import LOG_LEVELS, SAVE_POLICIES, BackendConfig


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


def _entries(raw: str, what: str) -> list[str]:
    """The entries of a comma-separated list, or of @FILE, one per line (blank lines and # comments skipped)."""
    raw = raw.strip()
    if not raw.startswith("@"):
        return [part.strip() for part in raw.split(",") if part.strip()]
    try:
        with open(raw[1:], encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as e:
        raise ValueError(f"cannot read the {what} {raw[1:]!r}: {e.strerror}") from None
    return [line for line in lines if line and not line.startswith("#")]


def _priorities(raw: str) -> tuple[tuple[str, str], ...]:
    """`KEY=CLASS` pairs, comma-separated, or @FILE with one pair per line; CLASS is high, normal or low."""
    pairs = []
    for part in _entries(raw, "file"):
        if part.startswith("#"):
            continue
        key, sep, level = part.rpartition("=")
        if not sep or not key.strip() or level.strip().lower() not in ("high", "normal", "low"):
            raise ValueError("expected KEY=high|normal|low pairs (the key itself is not shown here)")
        pairs.append((key.strip(), level.strip().lower()))
    return tuple(pairs)


def _keys(raw: str) -> tuple[str, ...]:
    """A comma-separated list of keys, or @FILE with one key per line (blank lines and # comments skipped)."""
    keys = _entries(raw, "key file")
    if raw.strip() and not keys:
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


def _tracing(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{raw!r} is not one of auto, on, off")
    return value


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
    Option("QUEUE_MAX", "--queue-max", _int(0), "0",
           "Requests that may wait for a slot at once; one more gets 429 with Retry-After at once (0: no bound). "
           "Whatever the bound, a request whose predicted wait passes its deadline (SLOT_WAIT_TIMEOUT, or "
           "X-Lpcache-Max-Wait) gets 503 with Retry-After before it waits.", metavar="N"),
    Option("CLIENT_PRIORITIES", "--client-priorities", _priorities, None,
           "Priority class per client key: KEY=high|normal|low pairs, comma-separated, or @FILE with one per line "
           "(keys of LPCACHE_API_KEYS; others are normal). A free slot goes to the highest class waiting, then to "
           "the client holding the fewest slots; a request may ask for a lower class than its key's with "
           "X-Lpcache-Priority (any class without client keys).", metavar="PAIRS"),
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
    Option("AGENT_SESSION_IDS", "--agent-session-ids", _bool, "true",
           "Without X-Session-ID, take the session ids coding agents send on their own as sessions: Claude Code's "
           "X-Claude-Code-Session-Id (its sub-agents' X-Claude-Code-Agent-Id), Codex's session-id, Claude Code's "
           "metadata.user_id on /v1/messages (see clients.md). false: X-Session-ID only.",
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
    Option("ORPHAN_GRACE_SECONDS", "--orphan-grace-seconds", _float(0.0), "900",
           "Delete a file in a slot-save folder named like a prefix cache that no meta file of any replica names "
           "(left by a crash) once nothing wrote it for this long; looked for every quarter of it (30 s at "
           "least). 0 = never (such files are only counted at start).", metavar="SECONDS"),
    Option("MODELS_MAX", "--models-max", _int(0), "4",
           "The --models-max of a llama-server router (0 = no limit): the slots of the model it is about to "
           "unload are saved first. Per backend: \"models_max\" in BACKENDS.", metavar="N"),
    Option("TRACING", "--tracing", _tracing, "auto",
           "OpenTelemetry traces of every request, a span per step (docs/tracing.md). auto: on when the standard "
           "OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_TRACES_EXPORTER is set (and "
           "OTEL_SDK_DISABLED is not true); on: always (OTLP over HTTP to the OTEL_EXPORTER_OTLP_* endpoint, "
           "http://localhost:4318 by default); off: never.", metavar="MODE"),
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
      "META_MAX", "META_MAX_GIB", "STREAM_QUEUE_SIZE", "COALESCE_REQUESTS", "AGENT_SESSION_IDS")),
    ("Backends", "The llama-server instances behind lpcache, and how a failing one is treated.",
     ("BACKENDS", "LLAMA_URL", "N_SLOTS", "SLOT_SAVE_PATH", "LLAMA_API_KEY", "REQUEST_TIMEOUT",
      "BREAKER_COOLDOWN_MS", "BREAKER_MAX_COOLDOWN_MS")),
    ("Saving and sessions", "When a slot's cache is written to disk, and how many session files are kept "
     "(see [sessions.md](sessions.md)).",
     ("SAVE_RETRIES", "SAVE_RETRY_DELAY_MS", "SAVE_POLICY", "SAVE_IDLE_SECONDS", "MAX_FILES", "MAX_GIB",
      "MODELS_MAX", "ORPHAN_GRACE_SECONDS")),
    ("Limits and hardening", "What a client may send and how long it may wait (see [operations.md](operations.md)).",
     ("SLOT_WAIT_TIMEOUT", "QUEUE_MAX", "CLIENT_PRIORITIES", "SLOT_AFFINITY_WAIT", "LPCACHE_API_KEYS",
      "CLIENT_SLOT_ACTIONS", "MAX_BODY_BYTES",
      "CLIENT_TIMEOUT", "SHUTDOWN_TIMEOUT")),
    ("Scale-out", "Several lpcache replicas sharing one cache map through Redis (see [scale-out.md](scale-out.md)).",
     ("REDIS_URL", "REPLICA_ID", "SLOT_LEASE_MS", "RING_FILES")),
    ("Plugins", "Prefilters, the request log and the dashboard (see [plugins.md](plugins.md)).",
     ("PLUGINS",)),
    ("Tracing", "OpenTelemetry traces of each request's steps (see [tracing.md](tracing.md)).", ("TRACING",)),
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
