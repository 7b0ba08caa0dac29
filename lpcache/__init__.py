"""lpcache: a KV-cache-aware, OpenAI-compatible proxy in front of llama.cpp llama-server instances.

The package by layer, each importing only those below it (pyproject.toml's import-linter contracts check it;
docs/architecture.md draws it): `edge` (HTTP server, CLI, metrics) and `integrations` (the LiteLLM hook) on top,
then `plugins`, the request `flow`, the `fleet` of replicas, `backends` (llama-server, its slots) and `apis` (the
generation APIs' shapes), the `cache` (what is saved and where), and `config` and `errors` under all. The stand-in
llama-server (`mock_llama`) and the workload generators (`workloads`) sit beside the proxy, which never imports them.
"""

from lpcache.config import BackendConfig, Settings, __version__, load_settings
from lpcache.config.moved import install as install_moved_paths
from lpcache.edge.app import create_app
from lpcache.errors import ConfigError, LpcacheError, ProxyError

__all__ = ["BackendConfig", "ConfigError", "LpcacheError", "ProxyError", "Settings", "__version__", "create_app",
           "load_settings"]

install_moved_paths()   # lpcache 0.1's flat module paths, deprecated (`config.moved`)
