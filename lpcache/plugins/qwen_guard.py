"""The Qwen guard prefilter (`qwen_guard`): asks a Qwen3Guard-Gen model whether a request is safe.

The guard is a separate llama-server running Qwen3Guard-Gen; the request's combined message text (its last
`max_chars` characters) is sent to its `/v1/chat/completions` as one user message, and the model answers with

    Safety: Safe|Unsafe|Controversial
    Categories: Violent, Jailbreak        (or "None")

The request is rejected (400, code `guard_rejected`) when the level is one of `reject_levels` or a category is one of
`reject_categories` (case-insensitive). When the guard cannot answer (connection error, timeout, non-200 status,
output that is not a verdict), `on_error` decides: "allow" lets the request through with a warning (fail-open),
"reject" refuses it with 503 `guard_unavailable` (fail-closed). Verdicts are kept in an LRU keyed by the SHA-256 of
the text sent; failures are never cached. A request without text is not sent to the guard.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from lpcache.plugins.base import ChatRequest, PluginError, Prefilter, Reject, Verdict, param

log = logging.getLogger("lpcache.plugins.qwen_guard")

LEVELS = ("Safe", "Unsafe", "Controversial")
PARAMS = frozenset({"url", "model", "api_key", "timeout_ms", "reject_levels", "reject_categories", "on_error",
                    "cache_size", "max_chars"})

_MARKUP = re.compile(r"[*_`#>]")
_SAFETY = re.compile(r"^\s*(?:[-+]\s+)?safety\s*:\s*(safe|unsafe|controversial)\b", re.IGNORECASE)
_CATEGORIES = re.compile(r"^\s*(?:[-+]\s+)?categor(?:y|ies)\s*:\s*(.*)$", re.IGNORECASE)


class GuardError(Exception):
    """The guard gave no usable verdict (unreachable, timed out, error status, unreadable answer)."""


@dataclass(frozen=True)
class GuardVerdict:
    """What the guard said: a level from LEVELS and the categories it named (none for "None")."""

    level: str
    categories: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.level}: {', '.join(self.categories)}" if self.categories else self.level


def parse_verdict(text: str) -> GuardVerdict:
    """The verdict in a Qwen3Guard-Gen answer: the first `Safety:` line (markdown such as `**Safety:** Unsafe`
    tolerated, any case) and the optional `Categories:` line after it. GuardError when there is no Safety line."""
    level: str | None = None
    categories: tuple[str, ...] = ()
    for raw in text.splitlines():
        line = _MARKUP.sub("", raw)
        if level is None:
            found = _SAFETY.match(line)
            if found:
                level = found.group(1).capitalize()
            continue
        cats = _CATEGORIES.match(line)
        if cats:
            names = (c.strip().rstrip(".").strip() for c in cats.group(1).split(","))
            categories = tuple(c for c in names if c and c.casefold() != "none")
            break
    if level is None:
        raise GuardError(f"no 'Safety:' verdict in the guard's answer {text[:200]!r}")
    return GuardVerdict(level, categories)


class QwenGuardPrefilter(Prefilter):
    """Rejects requests a Qwen3Guard-Gen llama-server classifies as hitting `reject_levels` / `reject_categories`."""

    name = "qwen_guard"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        p, n = self.params, self.name
        unknown = sorted(set(p) - PARAMS)
        if unknown:
            raise PluginError(f"plugin {n!r}: unknown parameter(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(sorted(PARAMS))})")
        if "url" not in p:
            raise PluginError(f"plugin {n!r}: parameter 'url' is required (the guard llama-server's base URL)")
        url = param(p, "url", str, None, plugin=n, check=_is_http_url, rule="an http(s) URL such as http://host:port")
        self.url: str = url.rstrip("/")
        self.endpoint = self.url + "/v1/chat/completions"
        self.model: str = param(p, "model", str, "qwen3guard", plugin=n, check=bool, rule="a non-empty string")
        self.api_key: str | None = param(p, "api_key", (str, type(None)), None, plugin=n,
                                         check=lambda v: v is None or bool(v), rule="a non-empty string")
        self.timeout_ms: int = param(p, "timeout_ms", int, 10000, plugin=n, check=lambda v: v > 0,
                                     rule="an integer > 0")
        levels = param(p, "reject_levels", list, ["Unsafe"], plugin=n, check=_are_levels,
                       rule=f"a list of {', '.join(LEVELS)}")
        self.reject_levels: frozenset[str] = frozenset(v.capitalize() for v in levels)
        cats = param(p, "reject_categories", list, [], plugin=n,
                     check=lambda v: all(isinstance(c, str) and c.strip() for c in v),
                     rule="a list of non-empty strings")
        self.reject_categories: frozenset[str] = frozenset(c.strip().casefold() for c in cats)
        self.on_error: str = param(p, "on_error", str, "allow", plugin=n, check=lambda v: v in ("allow", "reject"),
                                   rule='"allow" or "reject"')
        self.cache_size: int = param(p, "cache_size", int, 1024, plugin=n, check=lambda v: v >= 0,
                                     rule="an integer >= 0")
        self.max_chars: int = param(p, "max_chars", int, 32000, plugin=n, check=lambda v: v > 0,
                                    rule="an integer > 0")
        self.timeout = aiohttp.ClientTimeout(total=self.timeout_ms / 1000)
        self.headers = {"Content-Type": "application/json"}
        if self.api_key:
            self.headers["Authorization"] = f"Bearer {self.api_key}"
        self.cache: OrderedDict[str, GuardVerdict] = OrderedDict()
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession()

    async def stop(self) -> None:
        session, self.session = self.session, None
        if session is not None and not session.closed:
            await session.close()

    async def check(self, request: ChatRequest) -> Verdict:
        text = request.text[-self.max_chars:]
        if not text.strip():
            return None
        try:
            verdict = await self.classify(text)
        except GuardError as e:
            if self.on_error == "reject":
                log.warning("qwen_guard: %s; request rejected (on_error=reject)", e)
                return Reject(message="the content guard could not classify the request; try again later",
                              status=503, type="unavailable_error", code="guard_unavailable")
            log.warning("qwen_guard: %s; request allowed (on_error=allow)", e)
            return None
        return self.decide(verdict)

    def decide(self, verdict: GuardVerdict) -> Reject | None:
        """The policy: reject when the level or any category is configured as rejected."""
        hit = verdict.level in self.reject_levels or any(
            c.casefold() in self.reject_categories for c in verdict.categories)
        if not hit:
            return None
        return Reject(message=f"request rejected by the content guard ({verdict.describe()})", status=400,
                      type="invalid_request_error", code="guard_rejected")

    async def classify(self, text: str) -> GuardVerdict:
        """The guard's verdict on `text`, from the LRU when known. GuardError when the guard gives none."""
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            return cached
        verdict = parse_verdict(await self._ask(text))
        if self.cache_size > 0:
            self.cache[key] = verdict
            self.cache.move_to_end(key)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return verdict

    async def _ask(self, text: str) -> str:
        """The content of the guard's answer to `text`."""
        if self.session is None or self.session.closed:
            await self.start()
        assert self.session is not None
        body = orjson.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                             "temperature": 0, "max_tokens": 64, "stream": False})
        try:
            async with self.session.post(self.endpoint, data=body, headers=self.headers,
                                         timeout=self.timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise GuardError(f"no answer from the guard at {self.url} within {self.timeout_ms} ms") from None
        except (aiohttp.ClientError, OSError) as e:
            raise GuardError(f"guard at {self.url} unreachable: {e.__class__.__name__}: {e}") from e
        if status != 200:
            raise GuardError(f"guard at {self.url} answered {status}: {raw[:200].decode('utf-8', 'replace')!r}")
        try:
            content = orjson.loads(raw)["choices"][0]["message"]["content"]
        except (orjson.JSONDecodeError, LookupError, TypeError) as e:
            raise GuardError(f"guard at {self.url} answered something that is not a chat completion: {e}") from None
        if not isinstance(content, str):
            raise GuardError(f"guard at {self.url} answered without text content")
        return content


def _is_http_url(value: str) -> bool:
    try:
        parts = urlsplit(value)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc) and not parts.query and not parts.fragment


def _are_levels(value: list[Any]) -> bool:
    return all(isinstance(v, str) and v.capitalize() in LEVELS for v in value)
