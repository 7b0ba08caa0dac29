"""The HTTP edge: the ASGI app and its routes (`app`), the command line (`cli`), the HTTP server's limits (`http`),
the dashboard's browser login (`browser_login`), `/metrics` (`metrics`) and the configuration page's generator
(`config_page`). The top layer: it builds everything below from the settings and hands each request to the flow."""

from typing import Any


def __getattr__(name: str) -> Any:
    """lpcache 0.1's names of this path, when it was one module: read where they went, deprecated (`config.moved`)."""
    from lpcache.config.moved import old_name

    return old_name(__name__, name)
