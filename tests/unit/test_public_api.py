"""The package root exports a small, honest surface."""

import lpcache


def test_all_names_exist_and_are_the_whole_surface() -> None:
    for name in lpcache.__all__:
        assert hasattr(lpcache, name), name
    assert set(lpcache.__all__) == {"BackendConfig", "ConfigError", "LpcacheError", "ProxyError", "Settings",
                                    "__version__", "create_app", "load_settings"}
