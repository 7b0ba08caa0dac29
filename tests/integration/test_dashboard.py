"""The dashboard through lpcache and the stand-in: the figures of real requests (outcomes, tokens from the cache,
TTFT and latency percentiles, load per backend), the login a browser needs with client keys, and the history a
restart keeps."""

from __future__ import annotations

import os
import re
from typing import Any

import httpx
import pytest

from lpcache.edge.browser_login import COOKIE

from ..conftest import user, words
from .conftest import Proxy

BIG, SMALL = 200, 20
DASH = {"name": "dashboard", "params": {"path": "/dash"}}
KEY = "client-key-0123456789"


def fault(backend: Any, **faults: Any) -> None:
    httpx.post(f"{backend.url}/mock/faults", json=faults).raise_for_status()


def traffic(proxy: Proxy, headers: dict[str, str] | None = None) -> dict[str, int]:
    """Mixed requests: a long conversation (a miss, then a hit), short JSON and streams, a body that is not JSON
    and one of no chat shape (client errors). Returns what each outcome should count."""
    first = words(1, BIG)
    assert proxy.push(user(first), headers, stream=True).status_code == 200
    assert proxy.push(user(first + " and then some more words"), headers, stream=True).status_code == 200
    assert proxy.chat(user(words(2, SMALL)), headers).status_code == 200
    assert proxy.chat(user(words(3, SMALL)), headers, stream=True).status_code == 200
    bad_json = proxy.client.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert bad_json.status_code == 422
    assert proxy.client.post("/v1/chat/completions", json={"messages": "nope"}, headers=headers).status_code == 400
    return {"requests": 6, "served": 4, "client_errors": 2, "server_errors": 0, "streams": 3, "generation": 4}


def test_records_of_real_requests_show_up(start_backend: Any, start_proxy: Any) -> None:
    a, b = (start_backend(prefill_ms_per_token=0.5, gen_ms_per_token=2) for _ in range(2))   # time to show
    proxy = start_proxy(a, b, plugins=(DASH,))
    expected = traffic(proxy)
    fault(a, status=500, status_count=1)
    fault(b, status=500, status_count=1)
    assert proxy.chat(user(words(4, SMALL))).status_code == 500          # a backend's error, passed on
    proxy.wait_finished(expected["requests"] + 1)
    stats = proxy.client.get("/dash/api/stats", params={"since": 0}).json()
    life = stats["lifetime"]
    assert life["requests"] == 7 and life["served"] == 4 and life["client_errors"] == 2
    assert life["server_errors"] == 1 and life["success_rate"] == pytest.approx(4 / 5)
    assert life["by_status"] == {"2xx": 4, "3xx": 0, "4xx": 2, "5xx": 1, "other": 0}
    records = proxy.records
    assert life["cached_tokens"] == sum(r.cached_tokens or 0 for r in records) > BIG   # the second turn's hit
    assert life["computed_tokens"] == sum(r.prompt_n or 0 for r in records) > 0
    # TTFT of the three streams, latency of every generation request but the clients' errors
    streams = [r.ttft_ms for r in records if r.ttft_ms is not None]
    assert life["ttft_ms"]["n"] == len(streams) == expected["streams"]
    assert life["ttft_ms"]["max"] == pytest.approx(max(streams), abs=0.1)
    assert life["latency_ms"]["n"] == expected["generation"] + 1
    assert life["latency_ms"]["p50"] is not None and life["latency_ms"]["p99"] <= life["latency_ms"]["max"]
    # the range's series sums to the same, and names both stand-ins
    series = stats["range"]["series"]
    for name in ("requests", "served", "client_errors", "server_errors", "cached_tokens", "computed_tokens",
                 "ttft_n"):
        assert sum(p[name] for p in series) == (life[name] if name != "ttft_n" else len(streams)), name
    per_backend: dict[str, int] = {}
    for p in series:
        for url, load in p["backends"].items():
            per_backend[url] = per_backend.get(url, 0) + load["requests"]
    assert sum(per_backend.values()) == sum(1 for r in records if r.backend is not None) == 5
    assert set(per_backend) <= {a.url, b.url} and per_backend == {
        url: n["requests"] for url, n in life["backends"].items()}
    # busy: prefill and generation as the backends timed them (16 tokens at 2 ms at least, per answer)
    busy = sum(n["busy_secs"] for n in life["backends"].values())
    assert busy == pytest.approx(sum((r.prefill_ms or 0) + (r.gen_ms or 0) for r in records) / 1000, abs=0.01)
    assert busy >= 4 * 16 * 0.002
    assert [r["outcome"] for r in stats["recent"]][0] == "server_errors"
    # the page's own polls are in none of it
    assert proxy.client.get("/dash/api/stats").json()["lifetime"]["requests"] == 7


def cookie_of(resp: httpx.Response) -> str:
    match = re.match(rf"{COOKIE}=([^;]+)", resp.headers["set-cookie"])
    assert match
    return match.group(1)


def test_with_client_keys_a_browser_signs_in_with_the_form(start_backend: Any, start_proxy: Any) -> None:
    proxy = start_proxy(start_backend(), plugins=(DASH,), api_keys=(KEY, "another-key"))
    auth = {"authorization": f"Bearer {KEY}"}
    traffic(proxy, auth)
    proxy.wait_finished(6)
    with httpx.Client(base_url=proxy.url) as browser:   # no header, as a browser comes
        page = browser.get("/dash")
        assert page.status_code == 401 and '<form id="login"' in page.text
        assert browser.get("/dash/api/stats").status_code == 401
        assert browser.post("/dash", data={"key": "wrong"}).status_code == 401
        signed = browser.post("/dash", data={"key": KEY})
        assert signed.status_code == 303 and signed.headers["location"] == "dash"
        cookie = {"cookie": f"{COOKIE}={cookie_of(signed)}"}
        browser.cookies.clear()
        assert "kpi-requests" in browser.get("/dash", headers=cookie).text
        stats = browser.get("/dash/api/stats", headers=cookie).json()
        assert stats["lifetime"]["requests"] == 6 and stats["proxy"]["backends"][0]["n_slots"] == 2
        # the cookie is no key for anything else
        assert browser.post("/v1/chat/completions", json={"messages": user("hi")}, headers=cookie).status_code == 401
        assert browser.get("/metrics", headers=cookie).status_code == 401
        assert browser.get("/lpcache/sessions", headers=cookie).status_code == 401
        # the key once in the URL does the same, and leaves it out of where the browser goes next
        by_url = browser.get("/dash", params={"key": "another-key"})
        assert by_url.status_code == 303 and by_url.headers["location"] == "dash"
    assert proxy.client.get("/dash/api/stats", headers=auth).status_code == 200   # the header works as before
    # signing in is no request of the figures either
    assert proxy.client.get("/dash/api/stats", headers=auth).json()["lifetime"]["requests"] == 6


def test_the_history_survives_a_restart(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    first = start_proxy(backend, plugins=(DASH,))
    traffic(first)
    first.wait_finished(6)
    before = first.client.get("/dash/api/stats", params={"since": 0}).json()
    first.stop()
    path = os.path.join(first.settings.meta_dir, "dashboard-history.json")
    assert os.path.isfile(path)

    second = start_proxy(backend, plugins=(DASH,))
    after = second.client.get("/dash/api/stats", params={"since": 0}).json()
    assert after["lifetime"] == before["lifetime"] and after["lifetime"]["requests"] == 6
    assert after["recent"] == before["recent"] and after["history"]["file"] == path
    assert after["lifetime_since"] == before["lifetime_since"] < after["now"] - after["uptime_secs"]
    assert after["range"]["counters"]["requests"] == 6
    assert after["proxy"]["meta_entries"] == before["proxy"]["meta_entries"] > 0   # the index read its files
    assert second.chat(user(words(9, SMALL))).status_code == 200
    second.wait_finished(1)
    assert second.client.get("/dash/api/stats").json()["lifetime"]["requests"] == 7
