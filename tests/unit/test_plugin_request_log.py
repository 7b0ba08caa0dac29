"""The request_log plugin: XLF header, field rendering and escaping, field selection, size rotation with keep."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import lpcache
from lpcache.flow.record import RequestRecord
from lpcache.plugins.base import Observer, PluginError
from lpcache.plugins.request_log import FIELDS, RequestLog, render_value

STARTED = 1700000000.5  # 2023-11-14T22:13:20.500000Z


def make(tmp_path: Path, **params: Any) -> RequestLog:
    params.setdefault("path", str(tmp_path / "req.log"))
    return RequestLog(params)


def lines(path: Path) -> list[str]:
    return path.read_text("utf-8").splitlines()


def records(path: Path) -> list[str]:
    return [line for line in lines(path) if not line.startswith("#")]


def header(fields: tuple[str, ...] | list[str] = FIELDS) -> list[str]:
    return [f"#Software: lpcache-plugins/{lpcache.__version__}", "#Version: 1.0",
            "#Date-format: %Y-%m-%dT%H:%M:%S.%fZ", "#Fields: " + " ".join(fields)]


def success() -> RequestRecord:
    return RequestRecord(
        method="POST", path="/v1/chat/completions?x=1", client_ip="127.0.0.1", user_agent="curl/8.5.0",
        bytes_in=321, started=STARTED, elapsed_ms=1234.5678, status=200, bytes_out=4096, model="qwen3",
        stream=True, key="ab" * 32, n_words=612, big=True, backend="http://127.0.0.1:8000", slot=2, restored=True,
        cache_hit=True, coalesced=False, reason=None, prompt_tokens=800, completion_tokens=42, cached_tokens=768,
        prefill_ms=12.25, gen_ms=420.0, prefill_tps=2612.2449, gen_tps=100.0, ttft_ms=35.1239,
    )


# -- header and fields


def test_is_an_observer_named_request_log(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    assert isinstance(plugin, Observer)
    assert RequestLog.name == "request_log"


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plugin = RequestLog({})
    assert plugin.path == tmp_path / "lpcache-request.log"
    assert plugin.max_bytes == 10485760
    assert plugin.keep == 5
    assert plugin.fields == FIELDS
    assert len(FIELDS) == 28
    assert FIELDS == (
        "datetime", "cs-method", "cs-uri", "c-ip", "cs(User-Agent)", "cs-bytes", "cs-time", "sc-status", "sc-bytes",
        "lpcache-model", "lpcache-stream", "lpcache-key", "lpcache-n-words", "lpcache-is-big", "lpcache-backend",
        "lpcache-slot", "lpcache-restored", "lpcache-cache-hit", "lpcache-coalesced", "lpcache-reason",
        "lpcache-prompt-tokens", "lpcache-completion-tokens", "lpcache-cached-tokens", "lpcache-prefill-ms",
        "lpcache-gen-ms", "lpcache-prefill-tps", "lpcache-gen-tps", "lpcache-ttft-ms",
    )


def test_header_then_one_line_per_record(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    plugin.finished(success())
    plugin.finished(success())
    plugin.close()
    got = lines(tmp_path / "req.log")
    assert got[:4] == header()
    assert len(got) == 6
    assert got[4] == got[5]
    assert len(got[4].split(" ")) == 28


def test_relative_path_and_parent_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plugin = RequestLog({"path": "logs/deep/req.log"})
    plugin.finished(success())
    plugin.close()
    assert len(records(tmp_path / "logs" / "deep" / "req.log")) == 1


async def test_start_writes_header_and_stop_closes(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    await plugin.start()
    assert lines(tmp_path / "req.log") == header()
    await plugin.stop()
    assert plugin._file is None
    plugin.finished(success())  # reopens
    plugin.close()
    assert len(records(tmp_path / "req.log")) == 1
    assert lines(tmp_path / "req.log")[:4] == header()
    assert sum(line.startswith("#Version") for line in lines(tmp_path / "req.log")) == 1


def test_success_record_renders_every_field(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    plugin.finished(success())
    plugin.close()
    values = dict(zip(FIELDS, records(tmp_path / "req.log")[0].split(" "), strict=True))
    assert values == {
        "datetime": "2023-11-14T22:13:20.500000Z",
        "cs-method": "POST",
        "cs-uri": "/v1/chat/completions?x=1",
        "c-ip": "127.0.0.1",
        "cs(User-Agent)": "curl/8.5.0",
        "cs-bytes": "321",
        "cs-time": "1234.568",
        "sc-status": "200",
        "sc-bytes": "4096",
        "lpcache-model": "qwen3",
        "lpcache-stream": "true",
        "lpcache-key": "ab" * 32,
        "lpcache-n-words": "612",
        "lpcache-is-big": "true",
        "lpcache-backend": "http://127.0.0.1:8000",
        "lpcache-slot": "2",
        "lpcache-restored": "true",
        "lpcache-cache-hit": "true",
        "lpcache-coalesced": "false",
        "lpcache-reason": "-",
        "lpcache-prompt-tokens": "800",
        "lpcache-completion-tokens": "42",
        "lpcache-cached-tokens": "768",
        "lpcache-prefill-ms": "12.25",
        "lpcache-gen-ms": "420",
        "lpcache-prefill-tps": "2612.245",
        "lpcache-gen-tps": "100",
        "lpcache-ttft-ms": "35.124",
    }


def test_missing_values_render_as_dash(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    record = RequestRecord(method="GET", path="/v1/models", started=STARTED, status=502, reason="backend_error")
    line = plugin.render(record)
    values = dict(zip(FIELDS, line.split(" "), strict=True))
    assert values["cs-method"] == "GET"
    assert values["cs-uri"] == "/v1/models"
    assert values["sc-status"] == "502"
    assert values["sc-bytes"] == "0"
    assert values["lpcache-reason"] == "backend_error"
    rest = {k: v for k, v in values.items()
            if k not in ("datetime", "cs-method", "cs-uri", "sc-status", "sc-bytes", "lpcache-reason")}
    assert set(rest.values()) == {"-"}


def test_ttft_only_for_streams(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields=["lpcache-stream", "lpcache-ttft-ms"])
    assert plugin.render(RequestRecord(stream=True, ttft_ms=12.5)) == "true 12.5"
    assert plugin.render(RequestRecord(stream=False, ttft_ms=12.5)) == "false -"
    assert plugin.render(RequestRecord(stream=None, ttft_ms=12.5)) == "- -"
    assert plugin.render(RequestRecord(stream=True, ttft_ms=None)) == "true -"


# -- values


@pytest.mark.parametrize(("value", "expected"), [
    (None, "-"),
    (True, "true"),
    (False, "false"),
    (0, "0"),
    (42, "42"),
    (1.23456, "1.235"),
    (2.5, "2.5"),
    (3.0, "3"),
    (0.0004, "0"),
    (-0.0004, "0"),
    (1e20, "100000000000000000000"),
    (1e-7, "0"),
    (float("nan"), "-"),
    (float("inf"), "-"),
    ("plain", "plain"),
    ("", "-"),
    ("Mozilla/5.0 (X11)", '"Mozilla/5.0 (X11)"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("a\\b", '"a\\\\b"'),
    ("-leading", '"-leading"'),
    ("-", '"-"'),
    ('"quoted', '"\\"quoted"'),
    ("line\nbreak", '"line\\nbreak"'),
    ("cr\rtab\t", '"cr\\rtab\\t"'),
    ("bell\x07", '"bell\\x07"'),
    ("ünïcode", "ünïcode"),
])
def test_render_value(value: Any, expected: str) -> None:
    assert render_value(value) == expected


def test_quoting_keeps_one_record_per_line(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields=["cs(User-Agent)", "cs-uri", "lpcache-model"])
    plugin.finished(RequestRecord(user_agent='evil agent\n"x" \\ y', path="/a b", model="-m"))
    plugin.close()
    got = records(tmp_path / "req.log")
    assert got == ['"evil agent\\n\\"x\\" \\\\ y" "/a b" "-m"']


def test_float_fields(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields="cs-time,lpcache-prefill-ms,lpcache-gen-tps,lpcache-prompt-tokens")
    record = RequestRecord(elapsed_ms=0.1234, prefill_ms=10.0, gen_tps=99.9999, prompt_tokens=7)
    assert plugin.render(record) == "0.123 10 100 7"


# -- field selection and params


def test_field_subset_in_given_order(tmp_path: Path) -> None:
    chosen = ["sc-status", "lpcache-reason", "datetime", "cs-uri"]
    plugin = make(tmp_path, fields=chosen)
    plugin.finished(RequestRecord(path="/v1/chat/completions", started=STARTED, status=429, reason="slot_timeout"))
    plugin.close()
    got = lines(tmp_path / "req.log")
    assert got[:4] == header(chosen)
    assert got[3] == "#Fields: sc-status lpcache-reason datetime cs-uri"
    assert got[4] == "429 slot_timeout 2023-11-14T22:13:20.500000Z /v1/chat/completions"


def test_fields_as_comma_separated_string(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields=" cs-method , cs(user-agent),lpcache-key ")
    assert plugin.fields == ("cs-method", "cs(User-Agent)", "lpcache-key")


def test_empty_fields_string_means_all(tmp_path: Path) -> None:
    assert make(tmp_path, fields="").fields == FIELDS


@pytest.mark.parametrize("fields", [["cs-method", "cs-bogus"], "cs-method,cs-bogus"])
def test_unknown_field_is_an_error_naming_it(tmp_path: Path, fields: Any) -> None:
    with pytest.raises(PluginError, match="cs-bogus"):
        make(tmp_path, fields=fields)


@pytest.mark.parametrize("fields", [[], 5, ["cs-method", 3], {"cs-method": 1}])
def test_bad_fields_param(tmp_path: Path, fields: Any) -> None:
    with pytest.raises(PluginError, match="fields"):
        make(tmp_path, fields=fields)


@pytest.mark.parametrize("name", ["max_bytes", "keep"])
@pytest.mark.parametrize("value", [-1, 1.5, 2.0, True, "abc", "-3", None, [1]])
def test_bad_int_params(tmp_path: Path, name: str, value: Any) -> None:
    with pytest.raises(PluginError, match=name):
        make(tmp_path, **{name: value})


def test_int_params_accept_env_strings(tmp_path: Path) -> None:
    plugin = make(tmp_path, max_bytes="1024", keep=" 3 ")
    assert (plugin.max_bytes, plugin.keep) == (1024, 3)
    plugin = make(tmp_path, max_bytes=0, keep=0)
    assert (plugin.max_bytes, plugin.keep) == (0, 0)


@pytest.mark.parametrize("path", ["", "  ", 5, None])
def test_bad_path(path: Any) -> None:
    with pytest.raises(PluginError, match="path"):
        RequestLog({"path": path})


def test_unknown_param(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="max_byte"):
        make(tmp_path, max_byte=10)


# -- appending and rotation


def test_existing_file_is_appended_without_second_header(tmp_path: Path) -> None:
    first = make(tmp_path, fields=["cs-uri"])
    first.finished(RequestRecord(path="/one"))
    first.close()
    second = make(tmp_path, fields=["cs-uri"])
    second.finished(RequestRecord(path="/two"))
    second.close()
    assert lines(tmp_path / "req.log") == header(["cs-uri"]) + ["/one", "/two"]


def test_existing_foreign_file_gets_no_header(tmp_path: Path) -> None:
    (tmp_path / "req.log").write_text("old line\n")
    plugin = make(tmp_path, fields=["cs-uri"])
    plugin.finished(RequestRecord(path="/new"))
    plugin.close()
    assert lines(tmp_path / "req.log") == ["old line", "/new"]


def generations(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("keep", [1, 3])
def test_rotation_keeps_at_most_keep_generations(tmp_path: Path, keep: int) -> None:
    plugin = make(tmp_path, fields=["cs-uri"], max_bytes=1, keep=keep)  # every record fills a file
    for i in range(8):
        plugin.finished(RequestRecord(path=f"/r{i}"))
    plugin.close()
    path = tmp_path / "req.log"
    assert generations(tmp_path) == ["req.log"] + [f"req.log.{n}" for n in range(1, keep + 1)]
    assert lines(path) == header(["cs-uri"]) + ["/r7"]
    for n in range(1, keep + 1):
        assert lines(tmp_path / f"req.log.{n}") == header(["cs-uri"]) + [f"/r{7 - n}"]


def test_rotation_loses_no_record_and_respects_max_bytes(tmp_path: Path) -> None:
    fields = ["cs-uri"]
    head = len("".join(line + "\n" for line in header(fields)).encode())
    line = len(b"/r00\n")
    max_bytes = head + 3 * line
    plugin = make(tmp_path, fields=fields, max_bytes=max_bytes, keep=0)
    for i in range(20):
        plugin.finished(RequestRecord(path=f"/r{i:02d}"))
    plugin.close()
    names = generations(tmp_path)
    assert names == sorted(["req.log"] + [f"req.log.{n}" for n in range(1, 7)])  # 20 records, 3 per file
    got: list[str] = []
    for n in range(6, 0, -1):
        part = tmp_path / f"req.log.{n}"
        assert lines(part)[:4] == header(fields)
        assert part.stat().st_size <= max_bytes
        got += records(part)
    got += records(tmp_path / "req.log")
    assert got == [f"/r{i:02d}" for i in range(20)]


def test_keep_zero_keeps_all_generations(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields=["cs-uri"], max_bytes=1, keep=0)
    for i in range(12):
        plugin.finished(RequestRecord(path=f"/r{i}"))
    plugin.close()
    assert len(generations(tmp_path)) == 12
    assert records(tmp_path / "req.log.11") == ["/r0"]
    assert records(tmp_path / "req.log") == ["/r11"]


def test_max_bytes_zero_never_rotates(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields=["cs-uri"], max_bytes=0, keep=1)
    for i in range(200):
        plugin.finished(RequestRecord(path=f"/r{i}"))
    plugin.close()
    assert generations(tmp_path) == ["req.log"]
    assert len(records(tmp_path / "req.log")) == 200


def test_oversized_record_is_still_written(tmp_path: Path) -> None:
    plugin = make(tmp_path, fields=["cs-uri"], max_bytes=10, keep=2)
    plugin.finished(RequestRecord(path="/" + "x" * 100))
    plugin.close()
    assert generations(tmp_path) == ["req.log"]  # a file with only a header is never rotated away
    assert records(tmp_path / "req.log") == ["/" + "x" * 100]


def test_rotation_drops_stale_generations_beyond_keep(tmp_path: Path) -> None:
    for n in range(1, 6):
        (tmp_path / f"req.log.{n}").write_text(f"old {n}\n")
    (tmp_path / "req.log").write_text("current\n")
    plugin = make(tmp_path, fields=["cs-uri"], max_bytes=1, keep=2)
    plugin.finished(RequestRecord(path="/new"))
    plugin.close()
    assert generations(tmp_path) == ["req.log", "req.log.1", "req.log.2"]
    assert lines(tmp_path / "req.log.1") == ["current"]
    assert lines(tmp_path / "req.log.2") == ["old 1"]


# -- failures


def test_directory_as_path_logs_and_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plugin = RequestLog({"path": str(tmp_path)})
    with caplog.at_level(logging.DEBUG, logger="lpcache.request_log"):
        plugin.finished(success())
        plugin.finished(success())
        plugin.close()
    failures = [r for r in caplog.records if r.name == "lpcache.request_log" and "I/O failed" in r.message]
    assert len(failures) == 2
    assert failures[0].levelno == logging.WARNING
    assert failures[1].levelno == logging.DEBUG  # repeated failures do not flood the log


async def test_unwritable_parent_logs_and_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("x")
    plugin = RequestLog({"path": str(tmp_path / "file" / "req.log")})
    with caplog.at_level(logging.WARNING, logger="lpcache.request_log"):
        await plugin.start()
        plugin.finished(success())
        await plugin.stop()
    assert any("I/O failed" in r.message for r in caplog.records)


def test_recovers_after_failure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "later" / "req.log"
    (tmp_path / "later").write_text("in the way")
    plugin = RequestLog({"path": str(target), "fields": ["cs-uri"]})
    with caplog.at_level(logging.WARNING, logger="lpcache.request_log"):
        plugin.finished(RequestRecord(path="/lost"))
    (tmp_path / "later").unlink()
    plugin.finished(RequestRecord(path="/kept"))
    plugin.close()
    assert records(target) == ["/kept"]


def test_bad_record_does_not_raise(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    plugin.finished(object())
    plugin.close()
