"""The README's configuration table lists exactly the variables and flags the code accepts."""

import re
from pathlib import Path

from lpcache.config import OPTIONS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_table_matches_the_options() -> None:
    rows = re.findall(r"^\| `([A-Z_]+)` \| `(--[a-z-]+)` \|", README.read_text(), re.MULTILINE)
    assert rows == [(o.env, o.flag) for o in OPTIONS]
