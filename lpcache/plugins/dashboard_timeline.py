"""The dashboard's time series: a `Counts` per time bucket for the last `KEEP_SECS`, also summed per block of
`BLOCK` buckets, so that a range of a day costs blocks, not buckets; a range read as at most `MAX_POINTS` points.

Not thread-safe: the plugin holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

from lpcache.plugins.dashboard_stats import Counts

MAX_POINTS = 360          # at most this many points in a range's series
KEEP_SECS = 86400         # buckets older than this are dropped (the longest range the page asks for)
BLOCK = 16                # buckets per block


class Timeline:
    def __init__(self, bucket_secs: int) -> None:
        self.bucket_secs = bucket_secs
        self.block_secs = BLOCK * bucket_secs
        self.buckets: dict[int, Counts] = {}      # bucket start (unix seconds) -> its sums
        self.blocks: dict[int, Counts] = {}       # block start -> the sum of its buckets
        self._block_n: dict[int, int] = {}        # block start -> how many buckets it has
        self._starts: list[int] = []              # heap of the keys of `buckets`, oldest first

    def bucket_of(self, t: float) -> int:
        return int(math.floor(t / self.bucket_secs)) * self.bucket_secs

    def oldest(self) -> int | None:
        return self._starts[0] if self._starts else None

    def add(self, start: int, delta: Counts, now: float) -> bool:
        """Add `delta` to the bucket starting at `start` (a multiple of bucket_secs); False when that bucket is
        too old to be kept."""
        if start + self.bucket_secs <= now - KEEP_SECS:
            return False
        bucket = self.buckets.get(start)
        block_start = start - start % self.block_secs
        if bucket is None:
            bucket = self.buckets[start] = Counts()
            heapq.heappush(self._starts, start)
            self._block_n[block_start] = self._block_n.get(block_start, 0) + 1
            self.blocks.setdefault(block_start, Counts())
        bucket.add(delta)
        self.blocks[block_start].add(delta)
        return True

    def prune(self, now: float) -> None:
        horizon = now - KEEP_SECS
        while self._starts and self._starts[0] + self.bucket_secs <= horizon:
            start = heapq.heappop(self._starts)
            gone = self.buckets.pop(start)
            block_start = start - start % self.block_secs
            left = self._block_n.pop(block_start) - 1
            if left:
                self._block_n[block_start] = left
                self.blocks[block_start].sub(gone)
            else:
                del self.blocks[block_start]

    def series(self, first: int, last: int) -> tuple[Counts, list[dict[str, Any]]]:
        """The buckets from `first` to `last` (bucket starts, both included) as at most MAX_POINTS points, each
        merging adjacent buckets (zeros where nothing happened), and their summed counters. Points are aligned to
        multiples of their width: beyond BLOCK buckets a point is made of whole blocks but for the first and last."""
        b = self.bucket_secs
        total = Counts()
        if last < first:
            return total, []
        n = (last - first) // b + 1
        per = math.ceil(n / MAX_POINTS)
        if per > BLOCK:
            per = math.ceil(per / BLOCK) * BLOCK
        while last // (per * b) - first // (per * b) + 1 > MAX_POINTS:
            per += BLOCK if per >= BLOCK else 1
        width = per * b
        out = []
        for g in range(first // width, last // width + 1):
            lo, hi = max(first, g * width), min(last, g * width + width - b)
            c = self.sum(lo, hi)
            total.add(c)
            out.append(c.point(lo, hi + b - lo))
        return total, out

    def sum(self, lo: int, hi: int) -> Counts:
        """The sums of the buckets that start from `lo` to `hi` (both multiples of bucket_secs)."""
        b, size = self.bucket_secs, self.block_secs
        total = Counts()
        whole_lo = -(-lo // size) * size           # the whole blocks in [lo, hi + b)
        whole_hi = (hi + b) // size * size
        if whole_hi > whole_lo:
            for block_start in range(whole_lo, whole_hi, size):
                if (c := self.blocks.get(block_start)) is not None:
                    total.add(c)
            starts: Iterable[int] = itertools.chain(range(lo, whole_lo, b), range(whole_hi, hi + 1, b))
        else:
            starts = range(lo, hi + 1, b)
        for start in starts:
            if (c := self.buckets.get(start)) is not None:
                total.add(c)
        return total

    def spans(self, now: float, fine: int, coarse: int) -> Iterator[tuple[int, int, Counts]]:
        """Everything kept, oldest first, as (start, seconds, sums) in at most `fine` + `coarse` + 1 pieces: the
        last `fine` buckets as they are, the older ones merged into whole blocks (several blocks each when a day
        of blocks is more than `coarse`). For the history file, whose size this bounds."""
        if not self._starts:
            return
        b = self.bucket_secs
        last = self.bucket_of(now)
        cut = last - (fine - 1) * b                  # the first bucket kept as it is
        oldest = self._starts[0]
        if oldest < cut:
            width = self.block_secs * max(1, math.ceil(KEEP_SECS / self.block_secs / coarse))
            for g in range(oldest // width, (cut - b) // width + 1):
                lo, hi = max(oldest, g * width), min(cut - b, g * width + width - b)
                if width == self.block_secs and lo == g * width and hi == lo + width - b:
                    block = self.blocks.get(lo)               # one whole block: its sum as it is
                    c = block if block is not None else Counts()
                else:
                    c = self.sum(lo, hi)
                if c.requests or c.backends:
                    yield lo, hi + b - lo, c
        for start in range(max(cut, oldest), last + 1, b):
            if (bucket := self.buckets.get(start)) is not None:
                yield start, b, bucket
