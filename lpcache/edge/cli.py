"""The `lpcache` command: read the settings, set up logging, serve the app with uvicorn."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from lpcache.config import build_parser, load_settings
from lpcache.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_settings(args)
    except ConfigError as e:
        build_parser().exit(2, f"lpcache: error: {e}\n")
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from lpcache.backends.clients import backend_client
    from lpcache.cache.meta_files import check_meta_dir
    from lpcache.edge.app import create_app
    from lpcache.edge.http import server_options
    from lpcache.flow.plugin_api import PluginError
    from lpcache.plugins.registry import build

    try:
        plugins = build(settings.plugins)  # at once: a bad spec stops start-up before anything listens
    except PluginError as e:
        build_parser().exit(2, f"lpcache: error: PLUGINS: {e}\n")
    try:
        check_meta_dir(settings.meta_dir)   # before anything listens: one line, not a traceback from the app's start
    except ConfigError as e:
        build_parser().exit(2, f"lpcache: error: {e}\n")
    for backend in settings.backends:
        try:
            backend_client(backend.client)
        except PluginError as e:
            build_parser().exit(2, f"lpcache: error: BACKENDS: {e}\n")

    # uvicorn picks uvloop by itself when it is installed; the HTTP protocol is h11 with bounds on what a client
    # connection may hold (`edge.http`).
    uvicorn.run(create_app(settings, plugins), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False, lifespan="on",
                timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout)), **server_options(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
