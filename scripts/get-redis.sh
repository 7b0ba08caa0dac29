#!/usr/bin/env bash
# Debian's redis-server, for the scale-out tests (REDIS_URL): they start their own on free ports, never a mock.
set -euo pipefail
if command -v redis-server >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "get-redis: installing redis-server with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
else
    echo "get-redis: redis-server is needed for the scale-out tests: install it (apt-get install redis-server)" >&2
    exit 1
fi
