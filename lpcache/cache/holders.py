"""The index's lookup tables: a chain digest maps to the key of the one entry holding that block, or to the set of
keys when several do (most digests have one holder, so most cost no set)."""

from __future__ import annotations

from collections.abc import Sequence

Table = dict[int, str | set[str]]


def levels_of(table: dict[int, str | set[str]], chain: Sequence[int]) -> list[str | set[str]]:
    """The holders of each block of `chain` in a lookup table, from the first, while the table has them: level i
    holds the entries sharing the chain's first i+1 blocks."""
    levels: list[str | set[str]] = []
    for digest in chain:
        holders = table.get(digest)
        if holders is None:
            break
        levels.append(holders)
    return levels


def add_holder(table: dict[int, str | set[str]], digest: int, key: str) -> None:
    holders = table.get(digest)
    if holders is None:
        table[digest] = key
    elif isinstance(holders, str):
        if holders != key:
            table[digest] = {holders, key}
    else:
        holders.add(key)


def drop_holder(table: dict[int, str | set[str]], digest: int, key: str) -> None:
    holders = table.get(digest)
    if holders is None:
        return
    if isinstance(holders, str):
        if holders == key:
            del table[digest]
        return
    holders.discard(key)
    if len(holders) == 1:
        table[digest] = next(iter(holders))
    elif not holders:
        del table[digest]
