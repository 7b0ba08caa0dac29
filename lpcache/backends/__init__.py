"""The llama-servers behind lpcache: the HTTP client (`llama`, and `clients` for other client plugins), a backend
with its breaker and model identity (`backend`), its slots and who holds them (`slots`, `slot_truth`), the
`/slots` save / restore / erase calls (`swap`, the only module that makes them) and router-mode models
(`router_models`)."""

from typing import Any


def __getattr__(name: str) -> Any:
    """lpcache 0.1's names of this path, when it was one module: read where they went, deprecated (`config.moved`)."""
    from lpcache.config.moved import old_name

    return old_name(__name__, name)
