"""lpcache's version, the one place it is written (pyproject.toml's [tool.hatch.version] reads it here): a module of
its own, so that what shows the version (`-V`, /health, /metrics, the request log's header) needs nothing else of
the package (`lpcache/__init__` loads the app)."""

__version__ = "0.1.0"
