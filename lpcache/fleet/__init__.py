"""Several lpcache replicas through Redis: slot leases (`leases`), the shared map of index entries, sessions and
speeds (`shared_map`), and the replica that joins them (`replica`)."""

from typing import Any


def __getattr__(name: str) -> Any:
    """lpcache 0.1's names of this path, when it was one module: read where they went, deprecated (`config.moved`)."""
    from lpcache.config.moved import old_name

    return old_name(__name__, name)
