"""docs/configuration.md, written from the code: `python -m lpcache.edge.config_page` prints it, `make docs` saves it.

Every variable, flag, default and help text comes from `lpcache.config.OPTIONS`, and the keys of a `BACKENDS`
entry from `lpcache.config.BackendConfig`, so the page lists exactly what the code accepts. Only the grouping and
the prose around the tables live here. An option added to OPTIONS without a group still appears (under "Other
settings"); a BackendConfig field without a description here stops the generator, so it cannot be left out.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterable, Sequence

from lpcache.config import LOG_LEVELS, OPTIONS, SAVE_POLICIES, BackendConfig, Option, grouped
from lpcache.plugins.registry import BUILTINS

# The keys of one BACKENDS entry: (JSON type, default, meaning). One per BackendConfig field.
BACKEND_KEYS: dict[str, tuple[str, str, str]] = {
    "url": ("string, required", "-",
            "The server's base URL, `http://` or `https://` (a trailing `/` is dropped)."),
    "n_slots": ("integer, at least 1", "asked from the server",
                "Slot count. Unset: the server's `total_slots` from `GET /props`; on a router, each model's own "
                "count, asked when a request first names the model."),
    "slot_save_path": ("string", "none",
                       "The server's `--slot-save-path` folder as lpcache sees it (the same folder, or a shared "
                       "mount). lpcache deletes pruned KV files there and counts session files for `MAX_FILES` / "
                       "`MAX_GIB`. Backends with the same folder can restore each other's files; without it a "
                       "file is restored only on the server that wrote it."),
    "kv_cache": ("true or false", "true",
                 "false: this backend serves requests, but lpcache never saves or restores its slots and writes "
                 "no meta file for it (a server without `--slot-save-path`, or one too old for `/slots`)."),
    "client": ("string", "`\"llama\"`",
               "The backend-client plugin that talks to the server: `llama` (built in), or a class installed under "
               "the `lpcache.backend_clients` entry-point group. An unknown name stops start-up."),
    "router": ("true or false", "asked from the server",
               "A llama-server router (started without `-m`: many models, loaded on demand). Unset: a router is "
               "recognised by `role: router` in `GET /props`."),
    "max_files": ("integer, at least 0", "`MAX_FILES`", "This backend's `MAX_FILES`."),
    "max_gib": ("number, at least 0", "`MAX_GIB`", "This backend's `MAX_GIB`."),
    "models_max": ("integer, at least 0", "`MODELS_MAX`", "This backend's `MODELS_MAX` (a router's `--models-max`)."),
}

_NAMES = sorted({o.env for o in OPTIONS} | {"RUST_LOG"}, key=len, reverse=True)
_LEVELS = "|".join(sorted(LOG_LEVELS, key=len, reverse=True))
_CODE = re.compile(
    r"\[\{.*?\}\]|\[\]"                           # a JSON example: [{"url": ...}], []
    r"|\"[a-z_]+\""                                 # a JSON key: "max_files"
    r"|(?<![\w-])--[a-z][a-z-]*[a-z]"               # a flag
    r"|\b(?:" + "|".join(_NAMES) + r")\b\*?"        # a variable (REQUEST_LOG* too)
    r"|\bPREFILTER_\*"
    r"|\b(?:" + _LEVELS + r")\b"                    # a log level
    r"|Authorization: Bearer <\w+>"
    r"|[\w./{}-]*<\w+>[\w./{}-]*"                   # <key>.meta.json, <path>.1
    r"|\{\w+\}[\w.]*|@FILE\b|\blpcache\.[a-z_.]*[a-z]"
    r"|\b(?:GET|POST) /[a-z][\w/{}.-]*"             # GET /props
    r"|(?<![\w/])/[a-z][\w/{}.-]*[\w}]"             # /v1/models
    r"|\ball slots busy\b"
    r"|\b(?:" + "|".join(SAVE_POLICIES) + r")\b(?=:)"
    r"|\b[a-z]+(?:_[a-z]+)+\b"                      # total_slots, kv_cache, qwen_guard
    r"|\b(?:" + "|".join(sorted(BUILTINS, key=len, reverse=True)) + r"|chain)\b(?= plugin|,| \(|\))"
)


def markdown(text: str) -> str:
    """A help text as Markdown for a table cell: names, flags, paths and JSON in code spans, the rest escaped."""
    out, pos = [], 0
    for m in _CODE.finditer(text):
        out.append(_plain(text[pos:m.start()]))
        out.append("`" + m.group(0).replace("|", "\\|") + "`")
        pos = m.end()
    out.append(_plain(text[pos:]))
    return "".join(out)


def _plain(text: str) -> str:
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")
            .replace("<", "&lt;").replace(">", "&gt;"))


_KINDS = {
    "_text": "text",
    "_optional_text": "text (blank: unset)",
    "_url": "http(s) URL",
    "_redis_url": "`redis://`, `rediss://` or `unix://` URL",
    "_replica_id": "one word (letters, digits, `.` `_` `-`)",
    "_log_level": "level name",
    "_bool": "true/false",
    "_keys": "keys, or `@FILE`",
    "_priorities": "`KEY=CLASS` pairs, or `@FILE`",
    "_plugin_specs": "JSON array",
    "_backends": "JSON array",
    "_fields": "field names",
    "_save_policy": " or ".join(f"`{p}`" for p in SAVE_POLICIES),
    "_tracing": "`auto`, `on` or `off`",
    "_gib_or_auto": "GiB (at least 0), or `auto`",
    "_words_or_auto": "integer ≥ 0, or `auto`",
}


def _number(value: float) -> str:
    return f"{value:g}"


def value_kind(o: Option) -> str | None:
    """What a value must be, read from the option's parser (its range too); None for a parser not known here."""
    parse = o.parse
    name = parse.__qualname__
    if name in _KINDS:
        return _KINDS[name]
    cells = dict(zip(parse.__code__.co_freevars, (c.cell_contents for c in parse.__closure__ or ()), strict=True))
    kind = {"_int.<locals>.parse": "integer", "_float.<locals>.parse": "number"}.get(name)
    if kind is None:
        return None
    low, high = cells["minimum"], cells["maximum"]
    if high is not None:
        return f"{kind} {_number(low)} to {_number(high)}"
    return f"{kind} {'>' if cells.get('exclusive_min') else '≥'} {_number(low)}"


def _default(o: Option) -> str:
    return "unset" if o.default is None else f"`{o.default}`"


def option_table(options: Iterable[Option]) -> list[str]:
    rows = ["| Variable | Flag | Value | Default | Meaning |", "| --- | --- | --- | --- | --- |"]
    for o in options:
        rows.append(f"| `{o.env}` | `{o.flag}` | {value_kind(o) or o.metavar} | {_default(o)} | {markdown(o.help)} |")
    return rows


def backend_table() -> list[str]:
    fields = [f.name for f in dataclasses.fields(BackendConfig)]
    missing = [name for name in fields if name not in BACKEND_KEYS]
    if missing:
        raise SystemExit(f"lpcache.edge.config_page: describe the BACKENDS key(s) {', '.join(missing)} in BACKEND_KEYS")
    rows = ["| Key | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for name in fields:
        kind, default, meaning = BACKEND_KEYS[name]
        rows.append(f"| `{name}` | {kind} | {default} | {meaning} |")
    return rows


def page() -> str:
    levels = ", ".join(f"`{level}`" for level in LOG_LEVELS)
    policies = " or ".join(f"`{p}`" for p in SAVE_POLICIES)
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from lpcache/config/options.py by `make docs` (python -m lpcache.edge.config_page). Do not",
        "     edit this file: change the help text in lpcache/config/options.py or the prose in",
        "     lpcache/edge/config_page.py. -->",
        "",
        "Every setting has an environment variable and a command-line flag of the same meaning. The names and",
        "defaults are those of the Rust lpcache, plus a few of ours (see [migration.md](migration.md)), so an",
        "existing deployment's environment works unchanged. `lpcache -h` prints the same list; `lpcache -V` prints",
        "the version.",
        "",
        "## How a value is chosen",
        "",
        "- **A flag wins over the environment, and the environment over the default.** `PORT=9000 lpcache --port",
        "  9001` listens on 9001.",
        "- **Every value is checked at start.** A bad one stops lpcache before it listens, with one line naming the",
        "  variable and exit status 2, for example `lpcache: error: PORT: 'abc' is not an integer`. The same holds",
        "  for a `PLUGINS` spec that does not load (`lpcache: error: PLUGINS: ...`), a `BACKENDS` entry naming an",
        "  unknown client (`lpcache: error: BACKENDS: ...`), `BREAKER_MAX_COOLDOWN_MS` below",
        "  `BREAKER_COOLDOWN_MS`, and a blank `MODEL_ID`. An unknown flag is a usage error (status 2 as well);",
        "  environment variables lpcache does not know are ignored.",
        "- **true/false values** are `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off` and the empty string, in",
        "  any case. A true/false flag given bare means true: `--request-log` is `--request-log true`.",
        f"- **Log level**: `LOG_LEVEL` takes {levels}, in any case",
        "  (`TRACE` is `DEBUG`, `WARN` is `WARNING`). `RUST_LOG`, when it is one plain level such as `debug`,",
        "  replaces `LOG_LEVEL` from the environment or the default; a filter such as `lpcache=debug,hyper=info` is",
        "  ignored. `--log-level` wins over both.",
        "- **The start-up line** `app_start` logs the version, the backends with their slot counts, the meta files",
        "  loaded, the plugins (the request-log and prefilter variables appear as the plugins they become) and the",
        "  resolved settings, keys hidden: check it first when a setting seems ignored.",
        "",
        "The Value column is what the code accepts, ranges included (a number may have decimals, an integer may",
        "not). A default of `unset` means no value: the feature is off, or the code decides (see the meaning).",
        "",
        "## Routes lpcache serves",
        "",
        "lpcache caches every generation API llama-server serves: chat completions",
        "(`/v1/chat/completions`, `/chat/completions`), OpenAI Responses (`/v1/responses`, `/responses`),",
        "Anthropic Messages (`/v1/messages`), completions (`/v1/completions`, `/completions`, `/completion`) and",
        "infill (`/infill`). The settings below apply to all of them alike, `COALESCE_REQUESTS` too (for an API",
        "other than chat, only requests on the same path and in the same mode, JSON or stream, share a call); the",
        "`result_cache` plugin keeps chat completions only. Words (`BIG_THRESHOLD_WORDS`, `WORDS_PER_BLOCK`) are",
        "those of a prompt's text: message contents, a completion's `prompt` (each token id of a prompt of ids",
        "counts as a word), an infill's texts. What forms each API's cache identity:",
        "[operations.md](operations.md#generation-apis-and-what-is-cached); how to point clients at lpcache:",
        "[clients.md](clients.md).",
        "",
    ]
    for title, intro, options in grouped():
        lines += [f"## {title}", "", intro, "", *option_table(options), ""]
    lines += [
        "## The keys of a `BACKENDS` entry",
        "",
        "`BACKENDS` is a JSON array with one object per llama-server. Only `url` is required; any other key of",
        "the table below may be left out. When `BACKENDS` is unset, lpcache builds one entry from `LLAMA_URL`,",
        "`SLOT_SAVE_PATH` and `N_SLOTS` (`n_slots` only when `N_SLOTS` is set explicitly: otherwise the server",
        "is asked, and `N_SLOTS` is used only while it cannot be).",
        "",
        *backend_table(),
        "",
        "```sh",
        "BACKENDS='[{\"url\": \"http://10.0.0.5:8080\", \"slot_save_path\": \"/mnt/slots\"},",
        "           {\"url\": \"http://10.0.0.6:8080\", \"slot_save_path\": \"/mnt/slots\", \"n_slots\": 2},",
        "           {\"url\": \"http://10.0.0.7:8080\", \"kv_cache\": false}]' lpcache",
        "```",
        "",
        "## Examples",
        "",
        "One llama-server on this host, its slot files in `/var/cache/llama-slots`, everything else by default:",
        "",
        "```sh",
        "LLAMA_URL=http://127.0.0.1:8080 SLOT_SAVE_PATH=/var/cache/llama-slots lpcache",
        "```",
        "",
        "The same with flags, plus at most 20 GiB of session files per model, caches written only when their",
        f"slot is needed for another one or at shutdown (`SAVE_POLICY` is {policies}), and a request log:",
        "",
        "```sh",
        "lpcache --llama-url http://127.0.0.1:8080 --slot-save-path /var/cache/llama-slots \\",
        "  --max-gib 20 --save-policy evict --request-log --request-log-path /var/log/lpcache/req.log",
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    sys.stdout.write(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
