"""The dashboard's history file: its figures written to one JSON file (by default `dashboard-history.json` in
META_DIR), read back when lpcache starts, so a restart keeps the charts and the all-time counters.

The file is written atomically (a temporary file, fsync, rename), every `history_secs` when something changed
and at shutdown. Its size is bounded: the last `FINE` buckets as they are, older ones merged into at most `COARSE`
spans, the recent-requests ring (`max_recent`). A file that is not one lpcache wrote (corrupt, truncated, another
program's, larger than `MAX_BYTES`) is never fatal: it is logged, kept aside as `<file>.bad`, and the history
starts empty; a path that is not a regular file (a folder, a FIFO) is left alone and no history is written there.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import orjson

from lpcache.plugins.dashboard_stats import Counts, _num

log = logging.getLogger("lpcache.dashboard")

FORMAT = "lpcache-dashboard-history"
VERSION = 1
FINE = 720                   # the last 720 buckets (an hour at bucket_secs 5) are written as they are
COARSE = 1440                # older ones in at most this many spans (whole blocks: 80 s at bucket_secs 5)
MAX_BYTES = 32 * 1024 * 1024


class HistoryError(ValueError):
    """A history file lpcache cannot use (the reason is its message)."""


@dataclass
class History:
    """What the file holds, as the plugin hands it over and gets it back."""

    since: float                                    # when the history began (the first start it covers)
    bucket_secs: int
    lifetime: Counts
    spans: list[tuple[int, int, Counts]] = field(default_factory=list)   # (start, seconds, sums), oldest first
    recent: list[dict[str, Any]] = field(default_factory=list)           # oldest first
    saved_at: float = 0.0


def document(history: History) -> dict[str, Any]:
    """The file's JSON, detached from the live sums (build it under the plugin's lock, serialise it outside)."""
    return {
        "format": FORMAT, "version": VERSION, "saved_at": history.saved_at, "since": history.since,
        "bucket_secs": history.bucket_secs, "lifetime": history.lifetime.to_doc(),
        "spans": [[start, secs, c.to_doc()] for start, secs, c in history.spans],
        "recent": list(history.recent),
    }


def dump(history: History) -> bytes:
    return orjson.dumps(document(history))


def parse(data: bytes) -> History:
    """The history in `data`; HistoryError when it is not a file this format describes."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise HistoryError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise HistoryError(f"not an lpcache dashboard history (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise HistoryError(f"version {doc.get('version')!r}, this lpcache reads {VERSION}")
    since, saved_at, bucket_secs = _num(doc.get("since")), _num(doc.get("saved_at", 0.0)), doc.get("bucket_secs")
    if since is None or saved_at is None:
        raise HistoryError("since and saved_at are not numbers")
    if not isinstance(bucket_secs, int) or isinstance(bucket_secs, bool) or bucket_secs < 1:
        raise HistoryError("bucket_secs is not a positive integer")
    spans_doc, recent = doc.get("spans"), doc.get("recent", [])
    if not isinstance(spans_doc, list) or not isinstance(recent, list):
        raise HistoryError("spans and recent are not lists")
    if not all(isinstance(e, dict) and isinstance(e.get("time"), int | float) for e in recent):
        raise HistoryError("a recent request is not an object with a time")
    try:
        lifetime = Counts.from_doc(doc.get("lifetime"))
        spans = []
        for entry in spans_doc:
            if not (isinstance(entry, list) and len(entry) == 3 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in entry[:2]) and entry[1] > 0):
                raise ValueError("a span is [start, seconds, sums]")
            spans.append((entry[0], entry[1], Counts.from_doc(entry[2])))
    except ValueError as e:
        raise HistoryError(str(e)) from None
    return History(since=since, bucket_secs=bucket_secs, lifetime=lifetime, spans=spans, recent=recent,
                   saved_at=saved_at)


def read(path: str) -> History | None:
    """The history at `path`: None when there is none (no file yet, or a file that could not be used: logged and,
    when it is a regular file, kept aside as `<path>.bad`). OSError when the path cannot hold a history at all
    (a folder, a FIFO...): the caller then writes none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a regular file")
    try:
        if st.st_size > MAX_BYTES:
            raise HistoryError(f"larger than {MAX_BYTES} bytes")
        with open(path, "rb") as f:
            history = parse(f.read(MAX_BYTES + 1))
    except (HistoryError, OSError) as e:
        aside = path + ".bad"
        log.warning("dashboard_history_ignored file=%s reason=%s: kept as %s, the history starts empty", path, e,
                    aside)
        try:
            os.replace(path, aside)
        except OSError as moved:
            log.warning("dashboard_history_ignored file=%s could not be moved aside: %s", path, moved)
        return None
    return history


def write(path: str, data: bytes) -> None:
    """Replace the file at `path` with `data` in one step (readers see the old file or the new one)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
