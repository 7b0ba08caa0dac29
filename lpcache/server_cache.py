"""Where a prompt is likely still in a server's own RAM prompt cache (`--cache-ram`, on by default).

llama-server copies a slot's cache into RAM whenever a request replaces it (a pinned request to a slot holding
something else makes it look there too), so a conversation lpcache sent to one server is likely still in that
server's RAM after its slot was reused, and in no other server's. When no slot holds a prompt and no saved file
of it is left, sending it to that server, in a slot that holds something (an empty pinned slot skips the RAM
cache), lets the server find it; any other server computes it all. This remembers, per identity-chain digest,
the last server whose slot held it: the deepest digest of a prompt found here names that server.

A guess, never a claim: it only steers a request that would otherwise go to any slot, and is never reported as a
hit. Bounded: the oldest digests are forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

LIMIT = 200_000   # digests remembered (about 30 MB)


class ServerCaches:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._where: OrderedDict[int, int] = OrderedDict()   # chain digest -> backend index

    def __len__(self) -> int:
        return len(self._where)

    def held(self, backend: int, chain: Sequence[int]) -> None:
        """A slot of `backend` held the prompt of this chain."""
        where = self._where
        for digest in chain:
            where[digest] = backend
            where.move_to_end(digest)
        while len(where) > self.limit:
            where.popitem(last=False)

    def gone(self, backend: int, chain: Sequence[int]) -> None:
        """A restore replaced what a slot of `backend` held without the server copying it to RAM."""
        for digest in chain:
            if self._where.get(digest) == backend:
                del self._where[digest]

    def find(self, chain: Sequence[int]) -> tuple[int, int] | None:
        """(backend, blocks): the server that last held the longest prefix of the chain, and how much of it."""
        for depth in range(len(chain), 0, -1):
            backend = self._where.get(chain[depth - 1])
            if backend is not None:
                return backend, depth
        return None
