"""lpcache: a KV-cache-aware, OpenAI-compatible proxy in front of llama.cpp llama-server instances."""

from .app import create_app
from .config import BackendConfig, Settings, load_settings
from .errors import ConfigError, LpcacheError, ProxyError
from .version import __version__

__all__ = ["BackendConfig", "ConfigError", "LpcacheError", "ProxyError", "Settings", "__version__", "create_app",
           "load_settings"]
