"""Configuration: every variable, its flag, default and check (`options`), the values they make (`settings`), and
how flags, environment and defaults become them (`loading`).

The names, defaults and meanings are those of the Rust lpcache, so a deployment can switch without changing a
line. A value comes from its command-line flag, else its environment variable, else the default. Each value is
checked once; a bad one raises `ConfigError` naming the variable, and start-up stops with status 2.
"""

from lpcache.config.loading import build_parser, describe, load_settings, plugin_specs
from lpcache.config.options import (
           EXAMPLES,
           GROUPS,
           OPTIONS,
           OTHER_GROUP,
           Option,
           default_replica_id,
           grouped,
           shown_url,
)
from lpcache.config.settings import LOG_LEVELS, SAVE_POLICIES, BackendConfig, Settings
from lpcache.config.version import __version__
from lpcache.errors import ConfigError

__all__ = ["EXAMPLES", "GROUPS", "LOG_LEVELS", "OPTIONS", "OTHER_GROUP", "SAVE_POLICIES", "BackendConfig",
           "ConfigError", "Option", "Settings", "__version__", "build_parser", "default_replica_id", "describe",
           "grouped", "load_settings", "plugin_specs", "shown_url"]
