"""Slot save files: the filename rule and the on-disk format.

The filename rule follows llama.cpp's ``fs_validate_filename`` (no subdirectories), so
a proxy that passes the stand-in also passes the real server. The file format is the
stand-in's own: the real magic ``GGSQ`` and a version, then the cached token pieces as
JSON (pieces, not ids, so a file stays readable after a restart), padded with spaces to a real cache's size when
asked (``kv_bytes_per_token``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import orjson

MAGIC = b"GGSQ"
VERSION = 1
_HEADER = struct.Struct("<4sI")

_FORBIDDEN_CHARS = frozenset('/\\:*?"<>|')
_FORBIDDEN_CODEPOINTS = frozenset({0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF})


class SlotFileError(ValueError):
    """The file is missing, unreadable, or not a slot save file."""


def is_valid_filename(name: str) -> bool:
    """True if llama-server would accept ``name`` as a slot save file name."""
    if not name or name == "." or ".." in name:
        return False
    if name[0] == " " or name[-1] in " .":
        return False
    for ch in name:
        cp = ord(ch)
        if cp < 0x20 or 0x7F <= cp <= 0x9F or 0xD800 <= cp <= 0xDFFF:
            return False
        if cp in _FORBIDDEN_CODEPOINTS or ch in _FORBIDDEN_CHARS:
            return False
    return len(name.encode("utf-8")) <= 255


def encode(tokens: Sequence[str], size: int = 0) -> bytes:
    """The bytes of a save file holding ``tokens``, padded with JSON whitespace to ``size`` bytes (a real model's
    KV cache weighs that much)."""
    data = _HEADER.pack(MAGIC, VERSION) + orjson.dumps(list(tokens))
    return data + b" " * (size - len(data)) if size > len(data) else data


def decode(data: bytes) -> list[str]:
    """The tokens of a save file; SlotFileError if it is not one of ours."""
    if len(data) < _HEADER.size:
        raise SlotFileError("file too short")
    magic, version = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise SlotFileError("bad magic or version")
    try:
        tokens = orjson.loads(data[_HEADER.size :])
    except orjson.JSONDecodeError as exc:
        raise SlotFileError("bad payload") from exc
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise SlotFileError("bad payload")
    return tokens
