"""The plugin interface: what built-in and third-party plugins implement (they import it as `lpcache.plugins.base`).

A plugin is a plain class named by `name`, built from its spec's `params` once at start (bad params raise
`PluginError`, which stops start-up naming the plugin). It implements the hooks it needs:

- `Prefilter.check(request)`: before coalescing, slot choice and dispatch; returns None (accept), a `Reject`, or a
  `Serve` (an answer given without the backend, with an optional post-serve cleanup).
- `Prefilter.answered(request, answer)`: after the backend answered a request this prefilter accepted (for a
  result cache to store it), when `Prefilter.wants_answer(request)` said so (lpcache keeps the answer only then).
- `Observer.finished(record)`: once per finished request (success, error, rejection, client gone).
- `Routes.routes()`: extra HTTP routes (the dashboard's), mounted before lpcache's catch-all forwarding;
  `Routes.browser_paths()`: those a browser opens, let in with a login cookie when client keys are set.
- `start()` / `stop()`: at lpcache's start and stop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from lpcache.errors import PluginError

log = logging.getLogger("lpcache.plugins")




@dataclass(frozen=True)
class ChatRequest:
    """What a prefilter sees of a chat request, after body parsing and cache-key computation."""

    body: Mapping[str, Any]            # the parsed JSON body (do not modify)
    key: str                           # lpcache's cache key: sha256(model + "\n" + raw prefix)
    model: str
    stream: bool
    text: str                          # the message contents joined by newlines (roles stripped)
    headers: Mapping[str, str]         # request headers, lower-case names, without credentials (see client_key)
    # Who asks, as a digest (never the key itself): of the client's lpcache key when LPCACHE_API_KEYS is set, else of
    # the credential header (Authorization, else X-Api-Key) that goes on to llama-server; None without one.
    client_key: str | None = None
    session: str | None = None         # the X-Session-ID header, as sent
    # The API it came by: chat, responses, messages, completions or infill (`lpcache.apis`). For the others, `body`
    # has their prompt as chat `messages` too, so a plugin that reads messages reads theirs.
    api: str = "chat"


@dataclass(frozen=True)
class Reject:
    """Refuse the request: the client gets this status and message in OpenAI's error shape."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    code: str = "rejected"


@dataclass(frozen=True)
class Serve:
    """Answer without the backend. `body` is the whole response body: a chat.completion JSON, or the SSE bytes of a
    stream when `content_type` is text/event-stream. `cleanup` runs once the answer has been sent."""

    body: bytes
    status: int = 200
    content_type: str = "application/json"
    cleanup: PostCleanup | None = None


@dataclass(frozen=True)
class Answer:
    """The backend's answer to an accepted request, as the client got it: a chat.completion (for streams, the
    completion aggregated from the events), or None when the stream could not be aggregated."""

    status: int
    completion: Mapping[str, Any] | None
    stream: bool
    raw: bytes = b""


Verdict = Reject | Serve | None

MAX_ANSWER_BYTES = 16 * 1024 * 1024  # an answer (JSON body, or SSE bytes) larger than this is not passed to `answered`


class PostCleanup:
    """Runs after a served answer was sent (e.g. RemoveAfterServe deletes a one-shot cached entry)."""

    async def run(self, request: ChatRequest) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class Plugin:
    """Base of every plugin. A subclass sets `name`, reads and checks its params in `__init__` (raising
    PluginError), and overrides the hooks it needs."""

    name: ClassVar[str] = ""
    # A folder for the plugin's own files (lpcache's META_DIR), set by lpcache before `start()`; None outside it.
    data_dir: str | None = None

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = dict(params or {})

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class Prefilter(Plugin):
    """Accepts, rejects or serves a chat request before it reaches a backend."""

    async def check(self, request: ChatRequest) -> Verdict:
        return None

    def wants_answer(self, request: ChatRequest) -> bool:
        """Whether `answered` is to be told the answer to `request`: lpcache keeps a copy of an answer (up to
        `MAX_ANSWER_BYTES`) only when a prefilter wants it, and streams it on without one otherwise. By default,
        when the plugin overrides `answered`."""
        return type(self).answered is not Prefilter.answered

    async def answered(self, request: ChatRequest, answer: Answer) -> None:
        return None


def answer_wanted_by(prefilters: Sequence[Prefilter], request: ChatRequest) -> list[Prefilter]:
    """The prefilters that want the answer to `request` (one that fails to say is left out, logged)."""
    wanting = []
    for plugin in prefilters:
        try:
            if plugin.wants_answer(request):
                wanting.append(plugin)
        except Exception:
            log.exception("plugin_failed plugin=%s hook=wants_answer", plugin.name)
    return wanting


class Observer(Plugin):
    """Told about every finished request, with its one record (`lpcache.flow.record.RequestRecord`)."""

    def finished(self, record: Any) -> None:
        return None


class Routes(Plugin):
    """Adds HTTP routes; `state` gives live proxy state to them (set by lpcache at start; lpcache's is awaitable,
    so reading it never blocks the event loop)."""

    state: Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]] | None = None

    def routes(self) -> Sequence[Any]:
        return ()

    def excluded_paths(self) -> Sequence[str]:
        """Paths left out of the request log and the aggregates (a dashboard's own polling)."""
        return ()

    def browser_paths(self) -> Sequence[str]:
        """Paths a browser opens, the page first, then what it fetches: with client keys, lpcache shows a login
        form at the page and lets a browser that gave a key in with a cookie, on these paths only
        (`lpcache.edge.browser_login`)."""
        return ()


Factory = Callable[[Mapping[str, Any]], Plugin]


def param(params: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any, *,
          plugin: str, check: Callable[[Any], bool] | None = None, rule: str = "") -> Any:
    """One parameter, checked: the right type (bool is not an int), and `check` when given. Raises PluginError."""
    value = params.get(name, default)
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _types(kind))
    if not ok or (check is not None and not check(value)):
        expected = rule or " or ".join(t.__name__ for t in _types(kind))
        raise PluginError(f"plugin {plugin!r}: parameter {name!r} must be {expected}, got {value!r}")
    return value


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
