"""Running the prefilter plugins on a request: the first that rejects or serves decides; one that fails is logged
and skipped (it did not reject on purpose)."""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Sequence

from lpcache.errors import ProxyError
from lpcache.flow.plugin_api import ChatRequest, Prefilter, Reject, Serve
from lpcache.flow.record import RequestRecord, now_ns

log = logging.getLogger("lpcache.pipeline")


async def run(prefilters: Sequence[Prefilter], view: ChatRequest, record: RequestRecord) -> Serve | None:
    """The prefilters in order: a Reject raises the client's error, a Serve is returned, else None."""
    for plugin in prefilters:
        started = now_ns()
        try:
            verdict = await plugin.check(view)
        except Exception:
            record.step("prefilter", started, plugin=plugin.name, verdict="failed")
            log.exception("prefilter_failed plugin=%s: the request goes on", plugin.name)
            continue
        record.step("prefilter", started, plugin=plugin.name, verdict=type(verdict).__name__.lower() if verdict
                    else "pass")
        if isinstance(verdict, Reject):
            record.reason, record.prefilter = "prefilter_reject", f"{plugin.name}:reject"
            log.info("prefilter_reject plugin=%s key=%s", plugin.name, view.key[:16])
            raise ProxyError(verdict.message, status=verdict.status, type=verdict.type, code=verdict.code)
        if isinstance(verdict, Serve):
            record.prefilter = f"{plugin.name}:serve"
            log.info("prefilter_serve plugin=%s key=%s", plugin.name, view.key[:16])
            return verdict
    return None


async def quietly(coro: Coroutine[None, None, None], name: str) -> None:
    """A plugin's `answered` hook, its failure logged (the answer already went out)."""
    try:
        await coro
    except Exception:
        log.exception("plugin_failed plugin=%s hook=answered", name)
