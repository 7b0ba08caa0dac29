"""The docs cannot drift from the code: docs/configuration.md is the generator's output and lists exactly the
variables, flags and BACKENDS keys the code accepts; the other pages name only variables, metrics and log lines
that exist, and link only to files and headings that exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lpcache import config
from lpcache.config import OPTIONS, BackendConfig, build_parser
from lpcache.edge import config_page as config_doc

from ..metric_names import served

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SOURCE = "\n".join(p.read_text() for p in sorted((ROOT / "lpcache").rglob("*.py")))
OPTION_NAMES = {o.env for o in OPTIONS}

# The Rust lpcache's variables, from its README's configuration table: docs/migration.md lists them as kept, and
# everything else in OPTIONS as added.
RUST_VARIABLES = {
    "BACKENDS", "LLAMA_URL", "N_SLOTS", "WORDS_PER_BLOCK", "BIG_THRESHOLD_WORDS", "LCP_TH", "META_DIR", "META_MAX",
    "SLOT_SAVE_PATH", "REQUEST_TIMEOUT", "MODEL_ID", "PORT", "LLAMA_API_KEY", "LOG_LEVEL", "STREAM_QUEUE_SIZE",
    "COALESCE_REQUESTS", "PLUGINS", "REQUEST_LOG", "REQUEST_LOG_PATH", "REQUEST_LOG_MAX_BYTES", "REQUEST_LOG_KEEP",
    "REQUEST_LOG_FIELDS", "PREFILTER_BLOCKLIST", "PREFILTER_CASE_INSENSITIVE", "PREFILTER_RESULT_CACHE_DIR",
    "PREFILTER_RESULT_CACHE_TTL", "SAVE_RETRIES", "SAVE_RETRY_DELAY_MS",
}
# Upper-case names the pages may use that are not lpcache settings.
FOREIGN_NAMES = {
    "RUST_LOG", "LPCACHE_CACHE",
    "PROMETHEUS_DISABLE_CREATED_SERIES",   # prometheus_client's, in operations.md's metrics section
    # early proxycache settings, in docs/migration.md's renaming table
    "LLAMA_SERVER_URL", "SLOTS_COUNT", "LLAMA_BACKENDS", "LOCAL_META_DIR", "SIMILARITY_MIN_RATIO",
    "MIN_PREFIX_WORDS", "MIN_PREFIX_CHARS", "MIN_PREFIX_BLOCKS", "THRESHOLD_MODE", "SLOT_SAVE_MOUNT", "PINNED_KEYS",
    "SYSTEM_PROMPT_FILE", "DISK_META_SCAN_LIMIT", "ADD_BOS", "LOG_FORMAT", "LOG_DATEFMT",
}

OPTION_ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]*)` \| `(--[a-z][a-z-]*)` \| (.*?) \| (.*?) \| (.*) \|$", re.MULTILINE)
KEY_ROW = re.compile(r"^\| `([a-z_]+)` \| ", re.MULTILINE)
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def configuration() -> str:
    return (DOCS / "configuration.md").read_text()


def section(text: str, heading: str) -> str:
    """The text under a heading, up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading):]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.MULTILINE)
    return rest[: end.start() if end else len(rest)]


def upper_names(text: str) -> set[str]:
    """Variable-like names in code spans: upper case with an underscore (`META_MAX`, `REQUEST_LOG*`)."""
    names = set()
    for span in CODE.findall(text):
        for token in re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", span):
            names.add(token)
    return names


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def check_links(page: Path) -> list[str]:
    """Relative links of a page whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
            continue
        if fragment and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.MULTILINE)
            if fragment not in {anchor(h) for h in headings}:
                broken.append(target)
    return broken


# ---- docs/configuration.md ----

def test_the_committed_page_is_the_generated_one() -> None:
    assert configuration() == config_doc.page(), "docs/configuration.md is stale: run `make docs`"


def test_the_page_lists_exactly_the_options_with_their_defaults() -> None:
    rows = OPTION_ROW.findall(configuration())
    found = [(env, flag) for env, flag, *_ in rows]
    assert len(found) == len(set(found))
    assert sorted(found) == sorted((o.env, o.flag) for o in OPTIONS)
    by_env = {o.env: o for o in OPTIONS}
    for env, _flag, _kind, default, _help in rows:
        expected = by_env[env].default
        assert default == ("unset" if expected is None else f"`{expected}`"), env


def test_the_page_lists_exactly_the_flags_the_parser_accepts() -> None:
    parser_flags = {}
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag not in ("--help", "--version"):
                parser_flags[flag] = action.dest
    page_flags = {flag: env for env, flag, *_ in OPTION_ROW.findall(configuration())}
    assert page_flags == parser_flags


def test_the_page_lists_exactly_the_backends_keys() -> None:
    keys = KEY_ROW.findall(section(configuration(), "## The keys of a `BACKENDS` entry"))
    fields = [f.name for f in dataclasses.fields(BackendConfig)]
    assert keys == fields
    # and the parser takes every one of them under that name
    entry = ('[{"url": "http://h:1", "n_slots": 2, "slot_save_path": "/s", "kv_cache": false, "client": "llama", '
             '"router": true, "max_files": 3, "max_gib": 1.5, "models_max": 2}]')
    backend = config.load_settings(["--backends", entry], {}).backends[0]
    assert backend == BackendConfig("http://h:1", 2, "/s", False, "llama", True, 3, 1.5, 2)


def test_every_option_is_in_a_group_and_every_group_name_is_an_option() -> None:
    named = [name for _title, _intro, names in config.GROUPS for name in names]
    assert len(named) == len(set(named))
    assert set(named) == OPTION_NAMES, "sort the option into a group in lpcache/config/options.py GROUPS"


def test_every_value_kind_is_read_from_the_parser() -> None:
    for o in OPTIONS:
        assert config_doc.value_kind(o) is not None, \
            f"{o.env}: describe its parser in lpcache/edge/config_page.py _KINDS"


TRUE_FALSE = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def test_the_true_false_words_the_page_names_are_the_accepted_ones() -> None:
    rules = section(configuration(), "## How a value is chosen")
    parse = next(o.parse for o in OPTIONS if o.env == "REQUEST_LOG")
    for word, value in TRUE_FALSE.items():
        assert f"`{word}`" in rules
        assert parse(word.upper()) is value
    assert parse("") is False
    with pytest.raises(ValueError):
        parse("maybe")


def test_help_text_becomes_safe_markdown() -> None:
    assert config_doc.markdown("a <key>.meta.json | b") == "a `<key>.meta.json` \\| b"
    assert config_doc.markdown("x < y") == "x &lt; y"
    assert config_doc.markdown("see META_MAX and --meta-max") == "see `META_MAX` and `--meta-max`"


def test_the_generator_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_doc.main([]) == 0
    assert capsys.readouterr().out == config_doc.page()


# ---- the hand-written pages ----

@pytest.mark.parametrize("name", ["configuration.md", "operations.md", "migration.md", "deployment.md"])
def test_pages_link_only_to_what_exists(name: str) -> None:
    assert check_links(DOCS / name) == []


@pytest.mark.parametrize("name", ["operations.md", "migration.md"])
def test_pages_name_only_real_variables(name: str) -> None:
    unknown = upper_names((DOCS / name).read_text()) - OPTION_NAMES - FOREIGN_NAMES
    assert unknown == set()


def test_operations_names_only_metrics_lpcache_serves() -> None:
    text = (DOCS / "operations.md").read_text()
    names = set(re.findall(r"\blpcache_[a-z_]+", text))
    families = served()
    known = set(families) | {sample for samples in families.values() for sample in samples}
    assert names and names - known == set()
    assert set(families) - names == set(), "served, not documented in operations.md"


def test_operations_names_only_log_lines_lpcache_writes() -> None:
    table = section((DOCS / "operations.md").read_text(), "### The log lines")
    events = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split(" | ")[0]
        events.update(span.split()[0] for span in CODE.findall(first_cell))
    assert len(events) > 30
    for event in events:
        assert re.search(rf'"{re.escape(event)}[ :]', SOURCE), event


def test_migration_lists_the_kept_and_the_added_variables() -> None:
    text = section((DOCS / "migration.md").read_text(), "### Settings: the same names, a few more")
    kept = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \| `(--[a-z-]+)` \|$", text, re.MULTILINE)
    assert {env for env, _ in kept} == RUST_VARIABLES
    flags = {o.env: o.flag for o in OPTIONS}
    assert all(flags[env] == flag for env, flag in kept)
    added = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \| ([^|]+) \| [^|]+ \| [^|]+ \|$", text, re.MULTILINE)
    assert {env for env, _ in added} == OPTION_NAMES - RUST_VARIABLES
    defaults = {o.env: o.default or "unset" for o in OPTIONS}
    for env, default in added:
        assert default.strip("` ") == defaults[env], env


def test_architecture_lists_every_module() -> None:
    """docs/architecture.md's module table names every module of the package (a new one must say what it knows)."""
    page = (DOCS / "architecture.md").read_text()
    listed = set()
    for row in re.findall(r"^\| (`[^|]*) \|", page, re.MULTILINE):
        listed |= {name.rsplit("/", 1)[-1] for name in re.findall(r"`([a-z_/]+)/?`", row)}
    modules = {p.stem for p in (ROOT / "lpcache").rglob("*.py") if p.stem != "__init__"
               and "mock_llama" not in p.parts}
    assert modules - listed == set()
