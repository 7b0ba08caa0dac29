"""Backend clients as plugins: the built-in `llama` client, or a class installed under the `lpcache.backend_clients`
entry-point group and named in BACKENDS' "client" (a gateway that speaks llama-server's API its own way)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from lpcache.errors import PluginError

# classes built like lpcache.backends.llama.LlamaClient, named in BACKENDS "client"
CLIENT_GROUP = "lpcache.backend_clients"


def backend_client(name: str) -> Any:
    """The backend-client plugin of that name: the built-in `llama` (lpcache.backends.llama.LlamaClient), or one
    installed under the `lpcache.backend_clients` entry-point group, built as `Client(url, session, api_key=,
    timeout=)` and offering the same methods (chat, slot_action, get_json, total_slots, forward)."""
    if name == "llama":
        from lpcache.backends.llama import LlamaClient

        return LlamaClient
    for ep in entry_points(group=CLIENT_GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except (ImportError, AttributeError) as e:
                raise PluginError(f"backend client {name!r} cannot be loaded: {e}") from e
    raise PluginError(f"unknown backend client {name!r} (known: llama, and the {CLIENT_GROUP} entry points)")
