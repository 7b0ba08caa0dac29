#!/usr/bin/env bash
# Debian's chromium and chromium-driver, for the dashboard's browser test (Selenium drives them headless).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "get-browser: installing chromium and chromium-driver with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
else
    echo "get-browser: chromium and chromium-driver are needed for the browser test: install them" >&2
    exit 1
fi
