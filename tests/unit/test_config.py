"""Settings: defaults, precedence, checks, BACKENDS, and the command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest

import lpcache
from lpcache.config import OPTIONS, BackendConfig, Settings, build_parser, describe, load_settings
from lpcache.errors import ConfigError

SPEC_ENV_TO_FLAG = {
    "BACKENDS": "--backends",
    "LLAMA_URL": "--llama-url",
    "N_SLOTS": "--n-slots",
    "WORDS_PER_BLOCK": "--words-per-block",
    "BIG_THRESHOLD_WORDS": "--big-threshold-words",
    "LCP_TH": "--lcp-th",
    "META_DIR": "--meta-dir",
    "META_MAX": "--meta-max",
    "SLOT_SAVE_PATH": "--slot-save-path",
    "REQUEST_TIMEOUT": "--request-timeout",
    "MODEL_ID": "--model-id",
    "PORT": "--port",
    "LLAMA_API_KEY": "--api-key",
    "LOG_LEVEL": "--log-level",
    "STREAM_QUEUE_SIZE": "--stream-queue-size",
    "SAVE_RETRIES": "--save-retries",
    "SAVE_RETRY_DELAY_MS": "--save-retry-delay-ms",
}

# A valid value for every option, used to check that the parser accepts every flag.
VALID = {
    "BACKENDS": '[{"url": "http://h:1"}]',
    "LLAMA_URL": "http://h:2",
    "N_SLOTS": "3",
    "WORDS_PER_BLOCK": "7",
    "BIG_THRESHOLD_WORDS": "9",
    "LCP_TH": "0.5",
    "META_DIR": "/tmp/m",
    "META_MAX": "4",
    "SLOT_SAVE_PATH": "/tmp/s",
    "REQUEST_TIMEOUT": "12",
    "MODEL_ID": "mm",
    "HOST": "127.0.0.1",
    "PORT": "9999",
    "LLAMA_API_KEY": "secret",
    "LOG_LEVEL": "ERROR",
    "STREAM_QUEUE_SIZE": "2",
    "SAVE_RETRIES": "5",
    "SAVE_RETRY_DELAY_MS": "10",
    "SLOT_WAIT_TIMEOUT": "30",
    "QUEUE_MAX": "12",
    "CLIENT_PRIORITIES": "k2=HIGH, k1=low",
    "COALESCE_REQUESTS": "true",
    "AGENT_SESSION_IDS": "false",
    "LPCACHE_API_KEYS": "k1, k2",
    "MAX_BODY_BYTES": "1000",
    "CLIENT_TIMEOUT": "7.5",
    "BREAKER_COOLDOWN_MS": "50",
    "BREAKER_MAX_COOLDOWN_MS": "4000",
    "SHUTDOWN_TIMEOUT": "5",
    "SAVE_POLICY": "evict",
    "SAVE_IDLE_SECONDS": "2.5",
    "MAX_FILES": "3",
    "ORPHAN_GRACE_SECONDS": "120",
    "TRACING": "off",
    "MAX_GIB": "1.5",
    "MODELS_MAX": "2",
    "META_MAX_GIB": "2.5",
    "SLOT_AFFINITY_WAIT": "4",
    "CLIENT_SLOT_ACTIONS": "true",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    "REPLICA_ID": "replica-a",
    "SLOT_LEASE_MS": "5000",
    "RING_FILES": "8",
    "PLUGINS": '[{"name": "keyword", "params": {"keywords": ["x"]}}]',
    "REQUEST_LOG": "true",
    "REQUEST_LOG_PATH": "/tmp/r.log",
    "REQUEST_LOG_MAX_BYTES": "1000",
    "REQUEST_LOG_KEEP": "2",
    "REQUEST_LOG_FIELDS": "datetime,sc-status",
    "PREFILTER_BLOCKLIST": "a,b",
    "PREFILTER_CASE_INSENSITIVE": "false",
    "PREFILTER_RESULT_CACHE_DIR": "/tmp/rc",
    "PREFILTER_RESULT_CACHE_TTL": "60",
}


def load(argv=(), **env: str) -> Settings:
    return load_settings(list(argv), env)


def config_error(argv=(), **env: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(argv, **env)
    return info.value


# ---- defaults ----

def test_defaults_match_the_spec() -> None:
    s = load()
    assert s.words_per_block == 100
    assert s.big_threshold_words == 500
    assert s.lcp_th == 0.1
    assert s.meta_dir == "./kv_meta"
    assert s.meta_max == 10
    assert s.request_timeout == 600
    assert s.model_id == "llama.cpp"
    assert s.port == 8081
    assert s.host == "0.0.0.0"
    assert s.stream_queue_size == 16
    assert s.save_retries == 3
    assert s.save_retry_delay_ms == 1000
    assert s.n_slots == 1
    assert s.llama_api_key is None
    assert s.log_level == "INFO"
    assert s.backends == (BackendConfig("http://127.0.0.1:8000", None, None, True),)
    assert s.slot_save_paths == ()
    assert s.meta_max_gib is None and s.slot_affinity_wait == 30 and s.client_slot_actions is False
    assert all(source == "default" for source in s.sources.values())


def test_meta_max_gib_is_auto_or_a_size() -> None:
    assert load(META_MAX_GIB="auto").meta_max_gib is None
    assert load(META_MAX_GIB="AUTO").meta_max_gib is None
    assert load(META_MAX_GIB="0").meta_max_gib == 0
    assert load(["--meta-max-gib", "1.5"]).meta_max_gib == 1.5
    assert config_error(META_MAX_GIB="-1").variable == "META_MAX_GIB"
    assert config_error(META_MAX_GIB="lots").variable == "META_MAX_GIB"
    assert config_error(SLOT_AFFINITY_WAIT="-2").variable == "SLOT_AFFINITY_WAIT"


def test_big_threshold_words_is_a_count_or_auto_and_auto_counts_no_files_unless_told() -> None:
    auto = load(BIG_THRESHOLD_WORDS="auto")
    assert auto.big_threshold_words is None and auto.meta_max == 0   # META_MAX_GIB's bytes bound the files
    assert load(BIG_THRESHOLD_WORDS=" Auto ").big_threshold_words is None
    assert load(["--big-threshold-words", "auto"], META_MAX="25").meta_max == 25   # an explicit count is kept
    assert load(BIG_THRESHOLD_WORDS="auto", META_MAX="10").meta_max == 10
    assert load(BIG_THRESHOLD_WORDS="120").big_threshold_words == 120 and load().meta_max == 10
    assert "big_threshold_words=auto" in describe(auto) and "meta_max=0" in describe(auto)
    err = config_error(BIG_THRESHOLD_WORDS="many")
    assert err.variable == "BIG_THRESHOLD_WORDS" and "auto" in err.problem


def test_load_settings_ignores_the_process_environment_when_given_one(monkeypatch) -> None:
    monkeypatch.setenv("PORT", "1234")
    assert load().port == 8081
    assert load_settings([], None).port == 1234


# ---- precedence ----

@pytest.mark.parametrize(
    ("env", "flag", "flag_value", "env_value", "attr", "expected_flag", "expected_env"),
    [
        ("PORT", "--port", "9001", "9002", "port", 9001, 9002),
        ("META_MAX", "--meta-max", "3", "4", "meta_max", 3, 4),
        ("LCP_TH", "--lcp-th", "0.25", "0.75", "lcp_th", 0.25, 0.75),
        ("MODEL_ID", "--model-id", "flag-model", "env-model", "model_id", "flag-model", "env-model"),
        ("META_DIR", "--meta-dir", "/f", "/e", "meta_dir", "/f", "/e"),
        ("WORDS_PER_BLOCK", "--words-per-block", "11", "22", "words_per_block", 11, 22),
        ("LLAMA_API_KEY", "--api-key", "kf", "ke", "llama_api_key", "kf", "ke"),
        ("STREAM_QUEUE_SIZE", "--stream-queue-size", "1", "2", "stream_queue_size", 1, 2),
    ],
)
def test_flag_over_env_over_default(env, flag, flag_value, env_value, attr, expected_flag, expected_env) -> None:
    default = getattr(load(), attr)
    assert default not in (expected_flag, expected_env)
    from_env = load(**{env: env_value})
    assert getattr(from_env, attr) == expected_env
    assert from_env.sources[env] == "env"
    from_flag = load([flag, flag_value], **{env: env_value})
    assert getattr(from_flag, attr) == expected_flag
    assert from_flag.sources[env] == "flag"
    assert getattr(load([flag, flag_value]), attr) == expected_flag


def test_flag_wins_even_when_env_value_is_invalid() -> None:
    assert load(["--port", "9000"], PORT="not a port").port == 9000


def test_invalid_flag_value_is_an_error_even_with_a_valid_env() -> None:
    assert config_error(["--port", "0"], PORT="9000").variable == "PORT"


# ---- options and flags ----

def test_every_option_has_an_env_name_and_a_flag() -> None:
    envs = [o.env for o in OPTIONS]
    flags = [o.flag for o in OPTIONS]
    assert len(set(envs)) == len(envs)
    assert len(set(flags)) == len(flags)
    for o in OPTIONS:
        assert o.env and o.env == o.env.upper()
        assert o.flag.startswith("--") and len(o.flag) > 2
        assert o.help


def test_spec_variables_have_the_spec_flags() -> None:
    by_env = {o.env: o.flag for o in OPTIONS}
    for env, flag in SPEC_ENV_TO_FLAG.items():
        assert by_env.get(env) == flag, env


def test_parser_accepts_every_flag() -> None:
    assert set(VALID) == {o.env for o in OPTIONS}
    parser = build_parser()
    for o in OPTIONS:
        ns = parser.parse_args([o.flag, VALID[o.env]])
        assert getattr(ns, o.env) == VALID[o.env]
        keys = {"LPCACHE_API_KEYS": VALID["LPCACHE_API_KEYS"]} if o.env == "CLIENT_PRIORITIES" else {}
        assert load([o.flag, VALID[o.env]], **keys).sources[o.env] == "flag"
    argv = [arg for o in OPTIONS for arg in (o.flag, VALID[o.env])]
    s = load(argv)
    assert all(source == "flag" for source in s.sources.values())
    assert s.port == 9999 and s.host == "127.0.0.1" and s.slot_wait_timeout == 30


def test_every_option_from_env() -> None:
    s = load(**VALID)
    assert all(source == "env" for source in s.sources.values())
    assert s.backends == (BackendConfig("http://h:1"),)  # BACKENDS wins over LLAMA_URL / SLOT_SAVE_PATH
    assert (s.n_slots, s.words_per_block, s.big_threshold_words, s.lcp_th) == (3, 7, 9, 0.5)
    assert (s.meta_dir, s.meta_max, s.request_timeout, s.model_id) == ("/tmp/m", 4, 12.0, "mm")
    assert (s.host, s.port, s.llama_api_key, s.log_level) == ("127.0.0.1", 9999, "secret", "ERROR")
    assert (s.stream_queue_size, s.save_retries, s.save_retry_delay_ms, s.slot_wait_timeout) == (2, 5, 10, 30.0)
    assert (s.coalesce_requests, s.api_keys, s.max_body_bytes, s.client_timeout) == (True, ("k1", "k2"), 1000, 7.5)
    assert s.agent_session_ids is False
    assert (s.queue_max, s.client_priorities) == (12, (("k2", "high"), ("k1", "low")))
    assert (s.breaker_cooldown_ms, s.breaker_max_cooldown_ms, s.shutdown_timeout) == (50, 4000, 5.0)


@pytest.mark.parametrize("pairs, problem", [
    ("k1", "KEY=high|normal|low"), ("k1=urgent", "KEY=high|normal|low"), ("=high", "KEY=high|normal|low"),
    ("k3=high", "pair 1 names a key that is not in LPCACHE_API_KEYS"),
    ("k1=low,k9=high", "pair 2 names a key"),
])
def test_client_priorities_are_checked_without_showing_a_key(pairs: str, problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(LPCACHE_API_KEYS="k1,k2", CLIENT_PRIORITIES=pairs)
    assert e.value.variable == "CLIENT_PRIORITIES" and problem in str(e.value) and "k9" not in str(e.value)


def test_client_priorities_from_a_file(tmp_path: Any) -> None:
    f = tmp_path / "priorities"
    f.write_text("# interactive users first\nalpha-key=high\n\nbatch-key = low\n")
    s = load(LPCACHE_API_KEYS="alpha-key,batch-key", CLIENT_PRIORITIES=f"@{f}")
    assert s.client_priorities == (("alpha-key", "high"), ("batch-key", "low"))
    assert "client_priorities=key1=high,key2=low" in describe(s)
    with pytest.raises(ConfigError):
        load(LPCACHE_API_KEYS="a", CLIENT_PRIORITIES=f"@{tmp_path / 'missing'}")


def test_blank_api_key_means_no_auth() -> None:
    assert load(LLAMA_API_KEY="   ").llama_api_key is None


# ---- BACKENDS ----

def test_backends_valid_array() -> None:
    raw = (
        '[{"url": "http://a:8000/", "n_slots": 4, "slot_save_path": "/kv/a"},'
        ' {"url": "https://b:9000", "kv_cache": false},'
        ' {"url": "http://c:1", "n_slots": 2, "slot_save_path": "/kv/a", "kv_cache": true}]'
    )
    s = load(BACKENDS=raw, LLAMA_URL="http://ignored:1", SLOT_SAVE_PATH="/ignored")
    assert s.backends == (
        BackendConfig("http://a:8000", 4, "/kv/a", True),
        BackendConfig("https://b:9000", None, None, False),
        BackendConfig("http://c:1", 2, "/kv/a", True),
    )
    assert s.slot_save_paths == ("/kv/a",)


def test_backends_missing_n_slots_is_none() -> None:
    s = load(["--backends", '[{"url": "http://a:1"}]'], N_SLOTS="5")
    assert s.backends[0].n_slots is None
    assert s.backends[0].kv_cache is True


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "{",
        '{"url": "http://a:1"}',
        '"http://a:1"',
        "[]",
        "[1]",
        '["http://a:1"]',
        '[{"n_slots": 2}]',
        '[{"url": 5}]',
        '[{"url": "ftp://a:1"}]',
        '[{"url": "a:1"}]',
        '[{"url": "http://"}]',
        '[{"url": "http://a:1", "n_slots": 0}]',
        '[{"url": "http://a:1", "n_slots": -1}]',
        '[{"url": "http://a:1", "n_slots": "2"}]',
        '[{"url": "http://a:1", "n_slots": true}]',
        '[{"url": "http://a:1", "n_slots": 1.5}]',
        '[{"url": "http://a:1", "kv_cache": "yes"}]',
        '[{"url": "http://a:1", "kv_cache": 1}]',
        '[{"url": "http://a:1", "slot_save_path": 3}]',
        '[{"url": "http://a:1"}, {"url": "nope"}]',
    ],
)
def test_backends_invalid(raw: str) -> None:
    err = config_error(BACKENDS=raw)
    assert err.variable == "BACKENDS"
    assert str(err).startswith("BACKENDS: ")
    assert config_error(["--backends", raw]).variable == "BACKENDS"


# ---- single-backend fallback ----

def test_fallback_backend_from_llama_url_and_slot_save_path() -> None:
    s = load(LLAMA_URL="http://10.0.0.1:8080/", SLOT_SAVE_PATH="/kv")
    assert s.backends == (BackendConfig("http://10.0.0.1:8080", None, "/kv", True),)
    assert s.slot_save_paths == ("/kv",)


def test_fallback_n_slots_only_when_explicit() -> None:
    assert load().backends[0].n_slots is None
    assert load(N_SLOTS="1").backends[0].n_slots == 1
    assert load(N_SLOTS="3").backends[0].n_slots == 3
    assert load(["--n-slots", "2"]).backends[0].n_slots == 2
    assert load(["--n-slots", "2"], N_SLOTS="3").backends[0].n_slots == 2


def test_fallback_blank_slot_save_path_is_unset() -> None:
    s = load(SLOT_SAVE_PATH="  ")
    assert s.backends[0].slot_save_path is None
    assert s.slot_save_paths == ()


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h", "http://", ""])
def test_bad_llama_url(url: str) -> None:
    assert config_error(LLAMA_URL=url).variable == "LLAMA_URL"


def test_slot_save_paths_dedupes_in_order() -> None:
    s = Settings(backends=(
        BackendConfig("http://a:1", slot_save_path="/x"),
        BackendConfig("http://b:1"),
        BackendConfig("http://c:1", slot_save_path="/y"),
        BackendConfig("http://d:1", slot_save_path="/x"),
    ))
    assert s.slot_save_paths == ("/x", "/y")


# ---- invalid values ----

@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("STREAM_QUEUE_SIZE", "0"),
        ("STREAM_QUEUE_SIZE", "-3"),
        ("META_MAX", "-1"),
        ("LCP_TH", "-0.1"),
        ("LCP_TH", "1.5"),
        ("LCP_TH", "abc"),
        ("LCP_TH", "nan"),
        ("PORT", "0"),
        ("PORT", "65536"),
        ("PORT", "http"),
        ("REQUEST_TIMEOUT", "0"),
        ("REQUEST_TIMEOUT", "-5"),
        ("LOG_LEVEL", "loud"),
        ("WORDS_PER_BLOCK", "0"),
        ("N_SLOTS", "0"),
        ("N_SLOTS", "two"),
        ("SAVE_RETRIES", "-1"),
        ("SAVE_RETRY_DELAY_MS", "-1"),
        ("BIG_THRESHOLD_WORDS", "-1"),
        ("SLOT_WAIT_TIMEOUT", "0"),
        ("MODEL_ID", "  "),
    ],
)
def test_invalid_value_names_its_variable(env: str, value: str) -> None:
    err = config_error(**{env: value})
    assert err.variable == env
    assert err.problem
    assert str(err) == f"{env}: {err.problem}"


@pytest.mark.parametrize(
    ("env", "value", "attr", "expected"),
    [
        ("LCP_TH", "0", "lcp_th", 0.0),
        ("LCP_TH", "1", "lcp_th", 1.0),
        ("PORT", "1", "port", 1),
        ("PORT", "65535", "port", 65535),
        ("META_MAX", "0", "meta_max", 0),
        ("SAVE_RETRIES", "0", "save_retries", 0),
        ("BIG_THRESHOLD_WORDS", "0", "big_threshold_words", 0),
        ("REQUEST_TIMEOUT", "0.5", "request_timeout", 0.5),
        ("STREAM_QUEUE_SIZE", " 1 ", "stream_queue_size", 1),
    ],
)
def test_boundary_values_accepted(env: str, value: str, attr: str, expected) -> None:
    assert getattr(load(**{env: value}), attr) == expected


# ---- log level ----

@pytest.mark.parametrize(
    ("value", "expected"),
    [("trace", "DEBUG"), ("warn", "WARNING"), ("Warning", "WARNING"), ("debug", "DEBUG"), ("error", "ERROR"),
     (" info ", "INFO"), ("CRITICAL", "CRITICAL")],
)
def test_log_level_names(value: str, expected: str) -> None:
    assert load(LOG_LEVEL=value).log_level == expected
    assert load(["--log-level", value]).log_level == expected


def test_rust_log_overrides_log_level_env() -> None:
    s = load(LOG_LEVEL="error", RUST_LOG="debug")
    assert s.log_level == "DEBUG"
    assert load(RUST_LOG="warn").log_level == "WARNING"


def test_rust_log_does_not_override_the_flag() -> None:
    assert load(["--log-level", "error"], LOG_LEVEL="info", RUST_LOG="debug").log_level == "ERROR"


def test_rust_log_that_is_not_a_plain_level_is_ignored() -> None:
    assert load(LOG_LEVEL="error", RUST_LOG="lpcache=debug,tower=info").log_level == "ERROR"
    assert load(RUST_LOG="").log_level == "INFO"


# ---- the command line ----

def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.isupper() or k in ("PATH", "HOME", "PYTHONPATH", "LANG")}
    env["COLUMNS"] = "100"
    return subprocess.run([sys.executable, "-m", "lpcache", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_cli_bad_value_exits_2_with_one_line() -> None:
    r = run_cli("--lcp-th", "2")
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "LCP_TH" in lines[0]
    assert r.stdout == ""


def test_cli_version() -> None:
    r = run_cli("-V")
    assert r.returncode == 0
    assert re.fullmatch(r"\d+\.\d+\.\d+", lpcache.__version__)   # written once, in lpcache/__init__.py
    assert r.stdout.strip() == f"lpcache {lpcache.__version__}"
    assert run_cli("--version").stdout.strip() == f"lpcache {lpcache.__version__}"


def test_cli_help_mentions_every_variable_and_flag() -> None:
    r = run_cli("-h")
    assert r.returncode == 0
    for o in OPTIONS:
        assert o.env in r.stdout, o.env
        assert o.flag in r.stdout, o.flag


def test_help_text_in_process_mentions_every_variable() -> None:
    text = " ".join(build_parser().format_help().split())
    for o in OPTIONS:
        assert f"env {o.env}," in text, o.env


def test_hardening_defaults() -> None:
    s = load()
    assert (s.coalesce_requests, s.api_keys, s.max_body_bytes) == (False, (), 16 * 1024 * 1024)
    assert s.agent_session_ids is True
    assert (s.breaker_cooldown_ms, s.breaker_max_cooldown_ms, s.shutdown_timeout) == (1000, 60000, 30.0)


def test_api_keys_from_a_file(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nalpha\n\nbeta\n")
    assert load(["--api-keys", f"@{keys}"]).api_keys == ("alpha", "beta")
    with pytest.raises(ConfigError) as e:
        load(LPCACHE_API_KEYS=f"@{tmp_path / 'missing'}")
    assert e.value.variable == "LPCACHE_API_KEYS"


@pytest.mark.parametrize("env", [
    {"COALESCE_REQUESTS": "maybe"},
    {"MAX_BODY_BYTES": "0"},
    {"BREAKER_COOLDOWN_MS": "0"},
    {"BREAKER_COOLDOWN_MS": "5000", "BREAKER_MAX_COOLDOWN_MS": "1000"},
    {"SHUTDOWN_TIMEOUT": "-1"},
    {"LPCACHE_API_KEYS": " , "},
])
def test_bad_hardening_values(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as e:
        load(**env)
    assert e.value.variable in env


def test_backend_client_names() -> None:
    assert load(BACKENDS='[{"url": "http://h:1"}]').backends[0].client == "llama"
    with pytest.raises(ConfigError):
        load(BACKENDS='[{"url": "http://h:1", "client": 3}]')
    done = subprocess.run([sys.executable, "-m", "lpcache"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BACKENDS": '[{"url": "http://h:1", "client": "nosuch"}]'})
    assert done.returncode == 2 and "BACKENDS" in done.stderr and "nosuch" in done.stderr


def test_boolean_options_work_as_bare_flags() -> None:
    s = load(["--coalesce-requests", "--request-log"])
    assert s.coalesce_requests is True and [p["name"] for p in s.plugins] == ["request_log"]
    assert load(["--coalesce-requests", "false"]).coalesce_requests is False


# ---- session mode, save policy, limits, router ----

def test_save_policy_and_limits() -> None:
    s = load(SAVE_POLICY="Evict", SAVE_IDLE_SECONDS="2.5", MAX_FILES="3", MAX_GIB="1.5", MODELS_MAX="0",
             ORPHAN_GRACE_SECONDS="120")
    assert (s.save_policy, s.save_idle_seconds, s.max_files, s.max_gib, s.models_max) == ("evict", 2.5, 3, 1.5, 0)
    d = load()
    assert (d.save_policy, d.save_idle_seconds, d.max_files, d.max_gib, d.models_max) == ("eager", 0.0, 0, 0.0, 4)
    assert (s.orphan_grace_seconds, d.orphan_grace_seconds) == (120.0, 900.0)
    assert (load(TRACING=" On ").tracing, d.tracing) == ("on", "auto")
    with pytest.raises(ConfigError, match="TRACING"):
        load(TRACING="sometimes")
    assert load(["--save-policy", "evict", "--max-files", "2"]).max_files == 2


@pytest.mark.parametrize(("env", "value"), [("SAVE_POLICY", "lazy"), ("SAVE_IDLE_SECONDS", "-1"),
                                            ("MAX_FILES", "-2"), ("MAX_GIB", "x"), ("MODELS_MAX", "1.5")])
def test_bad_session_settings_name_the_variable(env: str, value: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(**{env: value})
    assert e.value.variable == env


def test_backend_router_and_limits() -> None:
    s = load(BACKENDS='[{"url": "http://h:1", "router": true, "max_files": 2, "max_gib": 0.5, "models_max": 1},'
                      ' {"url": "http://h:2"}]')
    a, b = s.backends
    assert (a.router, a.max_files, a.max_gib, a.models_max) == (True, 2, 0.5, 1)
    assert (b.router, b.max_files, b.max_gib, b.models_max) == (None, None, None, None)
    for bad in ('"router": "yes"', '"max_files": -1', '"max_gib": "big"', '"models_max": true'):
        with pytest.raises(ConfigError):
            load(BACKENDS='[{"url": "http://h:1", ' + bad + '}]')


def test_the_default_body_limit_holds_a_128k_token_chat_with_images() -> None:
    # Measured once with SmolLM2's tokenizer: chats.request's mix is about 2.1 tokens a counted word, 3.1 bytes a
    # token as JSON, so 62,000 words are about 128k tokens (larger vocabularies make it fewer tokens).
    import base64

    import orjson

    from lpcache.workloads import chats

    body = chats.request(7, 62000, chats.harness(1), turns=12)
    text_bytes = len(orjson.dumps(body))
    image = {"type": "image_url",
             "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(bytes(600_000)).decode()}}
    body["messages"][-1]["content"] = [{"type": "text", "text": body["messages"][-1]["content"]}] + [image] * 20
    assert text_bytes < 1_000_000
    assert len(orjson.dumps(body)) < Settings().max_body_bytes


# ---- start-up traps: an OpenAI base URL, the help, the start-up line ----

@pytest.mark.parametrize("given", ["http://gpu1:8080/v1", "http://gpu1:8080/v1/", " http://gpu1:8080/v1 "])
def test_a_backend_url_given_as_an_openai_base_url_is_cut_to_the_server_root_with_a_note(given: str) -> None:
    settings = load_settings(["--llama-url", given])
    assert [b.url for b in settings.backends] == ["http://gpu1:8080"]
    assert len(settings.notes) == 1 and "LLAMA_URL=http://gpu1:8080/v1" in settings.notes[0]
    settings = load_settings([], {"BACKENDS": f'[{{"url": "{given.strip()}"}}, {{"url": "http://h:1/llama/v1x"}}]'})
    assert [b.url for b in settings.backends] == ["http://gpu1:8080", "http://h:1/llama/v1x"]
    assert len(settings.notes) == 1 and settings.notes[0].startswith("config_url_fixed BACKENDS=")


def test_a_server_root_url_gives_no_note() -> None:
    assert load_settings(["--llama-url", "http://127.0.0.1:8080/llama"]).notes == ()


def test_the_help_is_grouped_as_the_configuration_page_and_its_examples_load() -> None:
    import shlex

    from lpcache.config import EXAMPLES, grouped

    text = build_parser().format_help()
    titles = [title for title, _, _ in grouped()]
    positions = [text.index(f"\n{title}:\n") for title in titles]
    assert positions == sorted(positions), "groups in the page's order"
    assert "docs/sessions.md" in text and "](" not in text, "links as paths"
    for what, line in EXAMPLES:
        assert line in text, what
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        assert words[0] == "lpcache"
        settings = load_settings(words[1:], env)   # every example is a valid configuration
        assert settings.backends, what


def test_the_start_up_line_names_each_setting_once_and_n_slots_only_when_set() -> None:
    from lpcache.config import describe

    line = describe(load_settings(["--llama-url", "http://a:1"], {"LPCACHE_API_KEYS": "k1,k2"}))
    keys = [part.partition("=")[0] for part in line.split(" ") if "=" in part]
    assert len(keys) == len(set(keys)), line
    assert "backends" not in keys and "plugins" not in keys and "n_slots" not in keys, line
    assert "lpcache_api_keys=2 key(s)" in line and "k1" not in line
    assert "n_slots=3" in describe(load_settings(["--n-slots", "3"]))


def test_passwords_in_urls_never_reach_the_start_up_line() -> None:
    from lpcache.config import describe, shown_url

    settings = load_settings(["--redis-url", "redis://:s3cret@redis:6379/0",
                              "--llama-url", "http://alice:pa55@gpu1:8080/v1"])
    line = describe(settings) + " ".join(settings.notes)
    assert "s3cret" not in line and "pa55" not in line, line
    assert "redis_url=redis://:***@redis:6379/0" in line and "alice:***@gpu1:8080" in line
    assert shown_url("http://gpu1:8080") == "http://gpu1:8080" and shown_url(None) is None
