"""The README cannot drift from the code: it points to the generated configuration page, names only variables and
flags that exist, and links only to files and headings that exist."""

import re
from pathlib import Path

from lpcache.config import OPTIONS
from tests.unit.test_docs import FOREIGN_NAMES, check_links, upper_names

README = Path(__file__).resolve().parents[2] / "README.md"
# llama-server's own flags the README explains (the others it names are lpcache's too: --port, --slot-save-path).
LLAMA_SERVER_FLAGS = {"--cache-ram", "--swa-full", "--metrics", "--api-key", "--no-slots"}
# `docker run`'s, in the container lines of the install section.
DOCKER_FLAGS = {"--name", "--network"}


def test_readme_points_to_the_generated_configuration_page() -> None:
    assert "](docs/configuration.md)" in README.read_text()


def test_readme_names_only_variables_the_code_reads() -> None:
    unknown = upper_names(README.read_text()) - {o.env for o in OPTIONS} - FOREIGN_NAMES
    assert unknown == set()


def test_readme_names_only_flags_that_exist() -> None:
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", README.read_text()))
    unknown = flags - {o.flag for o in OPTIONS} - LLAMA_SERVER_FLAGS - DOCKER_FLAGS
    assert unknown == set()


def test_readme_links_only_to_what_exists() -> None:
    assert check_links(README) == []
