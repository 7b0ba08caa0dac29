"""The metrics lpcache's /metrics serves, by name, for the tests that hold the docs and the Grafana dashboard to them.

Read from the exposition of a `Metrics` whose live state is a stand-in with every part present (backends, the
index, the disk figure, a Redis fleet), so that every family is there, those shown only with REDIS_URL included;
tests/integration/test_metrics.py checks the same names against a real app's scrape.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from unittest.mock import MagicMock

from lpcache.edge.metrics import Metrics

TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
SAMPLE_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}


def families(text: str) -> dict[str, set[str]]:
    """Each family of a Prometheus text exposition (its name as exposed, `_total` included) and the sample names a
    query can select of it."""
    return {name: {name + suffix for suffix in SAMPLE_SUFFIXES.get(kind, ("",))}
            for name, kind in TYPE_LINE.findall(text)}


def served() -> dict[str, set[str]]:
    """Every family lpcache can serve, with its sample names."""
    metrics = Metrics(lambda: MagicMock(), lambda: SimpleNamespace(value=1))
    return families(metrics.exposition().decode())


def served_samples() -> set[str]:
    return {sample for samples in served().values() for sample in samples}
