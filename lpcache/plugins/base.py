"""The plugin interface, at the path plugins import it from (`from lpcache.plugins.base import Prefilter`).

It is defined in `lpcache.flow.plugin_api`, beside the request flow that calls it, so that the flow never imports
the plugins' package; this module is its public name and stays one."""

from lpcache.flow.plugin_api import (
    MAX_ANSWER_BYTES,
    Answer,
    ChatRequest,
    Factory,
    Observer,
    Plugin,
    PluginError,
    PostCleanup,
    Prefilter,
    Reject,
    Routes,
    Serve,
    Verdict,
    answer_wanted_by,
    param,
)

__all__ = ["MAX_ANSWER_BYTES", "Answer", "ChatRequest", "Factory", "Observer", "Plugin", "PluginError", "PostCleanup",
           "Prefilter", "Reject", "Routes", "Serve", "Verdict", "answer_wanted_by", "param"]
