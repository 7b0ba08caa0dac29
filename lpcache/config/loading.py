"""From flags, environment and defaults to checked `Settings`: the CLI parser, the loader, and the start-up line's
summary."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lpcache.config.options import EXAMPLES, OPTIONS, _bool, _plain_intro, default_replica_id, grouped, shown_url
from lpcache.config.settings import LOG_LEVELS, BackendConfig, Settings
from lpcache.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per option, help written next to the option above, in docs/configuration.md's groups."""
    from lpcache.config.version import __version__

    epilog = "examples:\n" + "\n".join(f"  {what}:\n    {line}" for what, line in EXAMPLES) + (
        "\n\nEvery setting, its meaning and default: docs/configuration.md (python -m lpcache.edge.config_page).")
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
    keys = values["LPCACHE_API_KEYS"] or ()
    unknown = [i for i, (k, _) in enumerate(values["CLIENT_PRIORITIES"] or ()) if k not in keys]
    if unknown:
        raise ConfigError("CLIENT_PRIORITIES", f"pair {unknown[0] + 1} names a key that is not in LPCACHE_API_KEYS")

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
        queue_max=values["QUEUE_MAX"],
        client_priorities=values["CLIENT_PRIORITIES"] or (),
        coalesce_requests=values["COALESCE_REQUESTS"],
        agent_session_ids=values["AGENT_SESSION_IDS"],
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
        orphan_grace_seconds=values["ORPHAN_GRACE_SECONDS"],
        tracing=values["TRACING"],
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
        elif o.env == "CLIENT_PRIORITIES":
            value = ",".join(f"key{settings.api_keys.index(k) + 1 if k in settings.api_keys else '?'}={c}"
                             for k, c in settings.client_priorities) or "unset"
        else:
            value = getattr(settings, o.env.lower(), None)
        shown.append(f"{o.env.lower()}={value}")
    return " ".join(shown)
