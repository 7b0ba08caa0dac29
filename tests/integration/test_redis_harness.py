"""The real Redis the scale-out tests run against: started on a free port, restarted with its data, or lost."""

from __future__ import annotations

import redis

from lpcache.workloads.harness import RedisServer


def test_a_restarted_redis_keeps_what_it_saved_and_a_killed_one_loses_it(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert client.ping() is True
    client.set("lpcache:test", "kept")
    redis_server.restart()                       # SIGTERM: Redis saves its data, then starts from it
    client = redis.Redis.from_url(redis_server.url)
    assert client.get("lpcache:test") == b"kept"
    client.set("lpcache:test", "written after the save")
    redis_server.kill()                          # SIGKILL: what came after the last save is gone
    redis_server.restart()
    assert redis.Redis.from_url(redis_server.url).get("lpcache:test") == b"kept"
