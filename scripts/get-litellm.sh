#!/usr/bin/env bash
# Install a real LiteLLM proxy (litellm[proxy], pinned) for the tests of lpcache's LiteLLM hook, from PyPI only.
# It goes into a virtualenv of its own OUTSIDE the checkout, under $LPCACHE_CACHE (default ~/.cache/lpcache),
# keyed by version, so a second run (and CI on the same machine) takes well under a second. lpcache itself is NOT
# installed there: start the proxy with the checkout on PYTHONPATH (tests/e2e/litellm_rig.py does). Only those of
# lpcache's runtime dependencies (pyproject.toml) that litellm does not already bring are added to the virtualenv.
# Prints the paths as shell assignments:
#   LITELLM_BIN=...   LITELLM_PYTHON=...
set -euo pipefail

# 1.108.7 is the newest whose [proxy] extra installs from PyPI: 1.108.8 and later pin litellm-enterprise,
# litellm-proxy-extras or litellm-proxy versions that PyPI does not have. 1.107.0 was a compromised release:
# never install it. Change the pin only to a version that passes tests/e2e/test_litellm_rig.py.
LITELLM_VERSION="${LITELLM_VERSION:-1.108.7}"
case "$LITELLM_VERSION" in
    1.107.0|1.107.0.*) echo "get-litellm: litellm $LITELLM_VERSION was a compromised release, refusing" >&2; exit 1 ;;
esac
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${LPCACHE_CACHE:-$HOME/.cache/lpcache}"
PY="${PYTHON:-python3}"
VENV="$CACHE/litellm-$LITELLM_VERSION"

log() { echo "get-litellm: $*" >&2; }

# pip without the warnings about the local index folders of this machine's pip configuration that do not exist.
pip_in() {
    local python="$1"; shift
    "$python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# The requirements of lpcache (pyproject.toml) that the Python of $1 does not satisfy, one per line.
missing_requirements() {
    "$1" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    req = Requirement(dep)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        have = None
    if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
        print(f"{req.name}{req.specifier}")
EOF
}

add_lpcache_requirements() {
    local venv="$1" missing
    missing="$(missing_requirements "$venv/bin/python")"
    if [ -n "$missing" ]; then
        log "adding lpcache's requirements that litellm lacks: $(echo $missing)"
        # shellcheck disable=SC2086  # one requirement per word
        pip_in "$venv/bin/python" install --quiet $missing
        missing="$(missing_requirements "$venv/bin/python")"
        [ -z "$missing" ] || { log "still missing in $venv: $(echo $missing)"; exit 1; }
    fi
}

build() {
    local tmp="$VENV.tmp"
    rm -rf "$tmp"
    log "creating $VENV with litellm[proxy]==$LITELLM_VERSION (about a minute, once)"
    "$PY" -m venv --prompt "litellm-$LITELLM_VERSION" "$tmp"
    pip_in "$tmp/bin/python" install --quiet --upgrade pip
    pip_in "$tmp/bin/python" install --quiet "litellm[proxy]==$LITELLM_VERSION"
    add_lpcache_requirements "$tmp"
    # Publish atomically: a half-built virtualenv is never taken for a finished one. The scripts pip wrote name
    # their interpreter by absolute path, so they are pointed at the final folder before the rename.
    grep -rlI --null -F "$tmp" "$tmp/bin" "$tmp/pyvenv.cfg" | xargs -0 -r sed -i "s|$tmp|$VENV|g"
    rm -rf "$VENV"
    mv "$tmp" "$VENV"
}

mkdir -p "$CACHE"
exec 9>"$CACHE/litellm.lock"
flock 9  # one build at a time (parallel CI jobs on one machine)
[ -x "$VENV/bin/litellm" ] || build
# A dependency added to pyproject.toml since the virtualenv was made is added now (a no-op normally).
add_lpcache_requirements "$VENV"
have="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("litellm"))')"
[ "$have" = "$LITELLM_VERSION" ] || { log "$VENV has litellm $have, not $LITELLM_VERSION"; exit 1; }
echo "LITELLM_BIN=$VENV/bin/litellm"
echo "LITELLM_PYTHON=$VENV/bin/python"
