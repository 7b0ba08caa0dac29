"""lpcache: a KV-cache-aware, OpenAI-compatible proxy in front of llama.cpp llama-server instances."""

__version__ = "0.1.0"

from .app import create_app  # noqa: E402
from .config import BackendConfig, Settings, load_settings  # noqa: E402
from .errors import ConfigError, LpcacheError, ProxyError  # noqa: E402

__all__ = ["BackendConfig", "ConfigError", "LpcacheError", "ProxyError", "Settings", "__version__", "create_app",
           "load_settings"]
