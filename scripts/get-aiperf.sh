#!/usr/bin/env bash
# Install NVIDIA's aiperf (pinned), the outside benchmark tool of bench/aiperf_scenario.py, from PyPI only, with
# `gguf` and `tokenizers` beside it (bench/gguf_tokenizer.py builds aiperf's tokenizer from the GGUF file: aiperf
# reaches no model hub here). It goes into a virtualenv of its own OUTSIDE the checkout, under $LPCACHE_CACHE
# (default ~/.cache/lpcache), so a second run takes well under a second; one with another aiperf version (the pin
# changed) is made anew. lpcache is NOT installed there. Prints the paths as shell assignments:
#   AIPERF_BIN=...   AIPERF_PYTHON=...
set -euo pipefail

AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
CACHE="${LPCACHE_CACHE:-$HOME/.cache/lpcache}"
PY="${PYTHON:-python3}"
VENV="$CACHE/aiperf-venv"
EXTRA=("gguf>=0.17" "tokenizers>=0.20")

log() { echo "get-aiperf: $*" >&2; }

# pip without the warnings about the local index folders of this machine's pip configuration that do not exist.
pip_in() {
    local python="$1"; shift
    "$python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

build() {
    local tmp="$VENV.tmp"
    rm -rf "$tmp"
    log "creating $VENV with aiperf==$AIPERF_VERSION, gguf and tokenizers (a minute or two, once)"
    "$PY" -m venv --prompt "aiperf-$AIPERF_VERSION" "$tmp"
    pip_in "$tmp/bin/python" install --quiet --upgrade pip
    pip_in "$tmp/bin/python" install --quiet "aiperf==$AIPERF_VERSION" "${EXTRA[@]}"
    # Publish atomically: a half-built virtualenv is never taken for a finished one. The scripts pip wrote name
    # their interpreter by absolute path, so they are pointed at the final folder before the rename.
    grep -rlI --null -F "$tmp" "$tmp/bin" "$tmp/pyvenv.cfg" | xargs -0 -r sed -i "s|$tmp|$VENV|g"
    rm -rf "$VENV"
    mv "$tmp" "$VENV"
}

mkdir -p "$CACHE"
exec 9>"$CACHE/aiperf.lock"
flock 9  # one build at a time
installed() { "$VENV/bin/python" -c 'from importlib.metadata import version; import gguf, tokenizers
print(version("aiperf"))' 2>/dev/null; }
[ -x "$VENV/bin/aiperf" ] && [ "$(installed)" = "$AIPERF_VERSION" ] || build
have="$(installed)"
[ "$have" = "$AIPERF_VERSION" ] || { log "$VENV has aiperf ${have:-none}, not $AIPERF_VERSION"; exit 1; }
echo "AIPERF_BIN=$VENV/bin/aiperf"
echo "AIPERF_PYTHON=$VENV/bin/python"
