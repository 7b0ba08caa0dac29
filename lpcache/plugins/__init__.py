"""Plugins: the interface (`base`), the built-ins (one module each), and the registry that builds them from
PLUGINS specs. Third-party plugins register a factory under the `lpcache.plugins` entry-point group."""

from lpcache.plugins.base import (
    Answer,
    ChatRequest,
    Observer,
    Plugin,
    PluginError,
    PostCleanup,
    Prefilter,
    Reject,
    Routes,
    Serve,
    Verdict,
)

__all__ = ["Answer", "ChatRequest", "Observer", "Plugin", "PluginError", "PostCleanup", "Prefilter", "Reject",
           "Routes", "Serve", "Verdict"]
