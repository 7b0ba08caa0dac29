"""Which X-Session-ID values are a session, and the 32-hex id lpcache uses for each (`lpcache.cache.session_ids`)."""

from __future__ import annotations

import hashlib
import logging

import pytest

from lpcache.cache.session_ids import MAX_CHARS, SessionIds, header_bytes, is_session_id, read_session_id, session_id

HEX = "3f9a0c1d5b7e4a2c8d6f1e0b9a7c5d3e"   # as Marginalia sends it


def wire(text: str) -> str:
    """A header value as Starlette hands it over: the UTF-8 bytes the client sent, decoded as latin-1."""
    return text.encode("utf-8").decode("latin-1")


def sha32(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def test_32_lower_case_hex_digits_are_used_as_they_are() -> None:
    reading = read_session_id(HEX.encode())
    assert reading.id == HEX and not reading.hashed
    assert session_id(HEX) == HEX                       # the file names of existing sessions do not change


@pytest.mark.parametrize("value", [
    "6F9619FF-8B86-D011-B42D-00C04FC964FF",          # a UUID as .NET writes it
    "6f9619ff-8b86-d011-b42d-00c04fc964ff",          # ... and as Python's str(uuid4()) does
    "user-42", "User-42", "team/alice:draft #3", HEX.upper(), HEX + "0", HEX[:-1], "../../etc/passwd",
    "a", " leading and trailing ", "x" * MAX_CHARS,
])
def test_other_text_is_hashed_to_that_form(value: str) -> None:
    reading = read_session_id(value.encode())
    assert reading.hashed and reading.id == sha32(value)
    assert is_session_id(reading.id) and reading.id != value
    assert session_id(value) == reading.id              # the same every time: one value, one session


def test_distinct_values_are_distinct_sessions() -> None:
    values = ["user-42", "User-42", "user-42 ", "user_42", "6f9619ff-8b86-d011-b42d-00c04fc964ff",
              "6f9619ff8b86d011b42d00c04fc964ff"]
    ids = [session_id(v) for v in values]
    assert len(set(ids)) == len(values)
    assert ids[-1] == values[-1]                        # the UUID's hex form is already lpcache's


@pytest.mark.parametrize("name", ["Zoë Ångström", "李小龙", "Łódź — écrit ✍️", "Ольга/рассказ №2", "€uro",
                                  "🙂" * MAX_CHARS])
def test_unicode_names_hash_the_utf8_bytes_the_client_sent(name: str) -> None:
    as_header = session_id(wire(name))
    assert as_header == sha32(name)                      # printf %s "$name" | sha256sum | cut -c1-32
    assert read_session_id(name.encode("utf-8")).id == as_header   # the compare endpoint's UTF-8 path
    assert header_bytes(wire(name)) == name.encode("utf-8")


def test_a_string_beyond_latin1_is_taken_as_text() -> None:
    # not what an ASGI server hands over, but a caller holding real text gets the same session
    assert session_id("李小龙") == session_id(wire("李小龙"))


@pytest.mark.parametrize("raw, reason", [
    (b"", "empty"),
    (b"   ", "empty"),
    (b"x" * (MAX_CHARS + 1), "too_long"),
    ("ü".encode() * (MAX_CHARS + 1), "too_long"),
    (b"user\t42", "control_character"),
    (b"user-42\n", "control_character"),
    (b"\x00" + HEX.encode(), "control_character"),
    (b"del\x7f", "control_character"),
    ("nel\u0085".encode(), "control_character"),     # a C1 control, sent as UTF-8
    (b"Zo\xeb", "not_utf8"),                          # latin-1, not UTF-8
    (b"\xff\xfe", "not_utf8"),
])
def test_values_that_cannot_be_a_session_are_rejected(raw: bytes, reason: str) -> None:
    reading = read_session_id(raw)
    assert reading.id is None and reading.reason == reason
    assert session_id(raw.decode("latin-1")) is None


def test_a_rejected_value_is_counted_every_time_and_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    ids = SessionIds(logging.getLogger("test.session_ids"))
    secret = "Bearer sk-live-Überschrift\tzwei"
    with caplog.at_level(logging.WARNING, "test.session_ids"):
        assert [ids.read(wire(secret)) for _ in range(3)] == [None, None, None]
        assert ids.read("") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert f"session_id_rejected reason=control_character chars={len(secret)} " in lines[0]
    assert hashlib.sha256(secret.encode()).hexdigest()[:12] in lines[0]
    assert "sk-live" not in " ".join(lines) and "Überschrift" not in " ".join(lines)   # never the value
    assert "reason=empty" in lines[1]
    assert ids.rejected["control_character"] == 3 and ids.rejected["empty"] == 1 and ids.hashed == 0


def test_hashed_values_are_counted_and_the_exact_form_is_not() -> None:
    ids = SessionIds(logging.getLogger("test.session_ids"))
    assert ids.read(HEX) == HEX and ids.read(None) is None
    assert ids.hashed == 0
    assert ids.read("user-42") == sha32("user-42") and ids.read(wire("Zoë")) == sha32("Zoë")
    assert ids.hashed == 2 and sum(ids.rejected.values()) == 0


def test_the_warned_values_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    ids = SessionIds(logging.getLogger("test.session_ids"), warned_max=3)
    values = [f"line {i}\nbreak" for i in range(5)]
    with caplog.at_level(logging.WARNING, "test.session_ids"):
        for value in values:
            ids.read(value)
        assert len(ids._warned) == 3                   # the two oldest forgotten
        ids.read(values[4])                            # remembered: not warned again
        assert len(caplog.records) == 5
        ids.read(values[0])                            # forgotten: warned again
        assert len(caplog.records) == 6 and len(ids._warned) == 3
    assert ids.rejected["control_character"] == 7


def test_the_hooks_lines_carry_its_prefix(caplog: pytest.LogCaptureFixture) -> None:
    ids = SessionIds(logging.getLogger("test.session_ids"), prefix="slot_cache: ")
    with caplog.at_level(logging.WARNING, "test.session_ids"):
        ids.read("x" * 1000)
    assert caplog.records[0].getMessage().startswith("slot_cache: session_id_rejected reason=too_long chars=1000")
