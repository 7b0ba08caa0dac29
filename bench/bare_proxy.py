"""A bare pass-through proxy on lpcache's own stack: what any proxy hop costs, read beside lpcache's figures.

Where llama-server's RAM cache holds the working set, lpcache's best is to pass requests on (`flow.unpinned`), and
what is left between it and the server alone is the hop: one more HTTP server (uvicorn, h11, uvloop) and client
(aiohttp) on the same cores. This proxy is that hop and nothing else (no cache, no parsing, no slot): every request
goes to the upstream as it came, its answer back chunk by chunk. `bench/sharegpt_scenario.py`'s `bare-RAM` setups
run it in lpcache's place.

    python bench/bare_proxy.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import sys
from typing import Any

from lpcache.workloads.harness import _Process

HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}


def app_for(upstream: str) -> Any:
    """The ASGI app: each request to `upstream`, the answer streamed back as the upstream's chunks arrive."""
    import aiohttp

    session: aiohttp.ClientSession | None = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    if session is not None:
                        await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert session is not None
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_HEADERS}
        query = scope.get("query_string") or b""
        url = upstream + scope["path"] + ("?" + query.decode("latin-1") if query else "")
        async with session.request(scope["method"], url, data=body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=None)) as answer:
            await send({"type": "http.response.start", "status": answer.status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()
                                    if k.lower() not in HOP_HEADERS]})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


class BareProxy(_Process):
    """The proxy as a process of its own (as lpcache runs in the bench), in front of `upstream`."""

    name = "bare-proxy"

    def __init__(self, upstream: str, timeout: float = 30.0) -> None:
        super().__init__()
        self._start([sys.executable, __file__, upstream, str(self.port)], None, timeout)


def main() -> None:
    import uvicorn

    upstream, port = sys.argv[1].rstrip("/"), int(sys.argv[2])
    uvicorn.run(app_for(upstream), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                lifespan="on", http="h11")


if __name__ == "__main__":
    main()
