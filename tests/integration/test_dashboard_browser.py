"""The dashboard page in a real browser: headless Chromium driven by Selenium against the plugin's routes served by
uvicorn. Needs Debian's `chromium` and `chromium-driver` and pip's `selenium`; fails without them, unless pytest runs
with --browser-optional (make test-fast), which skips it when the two programs are missing.

With LPCACHE_SCREENSHOT=1 it also writes docs/dashboard.png (normal runs leave the tree alone)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette

from lpcache.flow.record import RequestRecord, Step
from lpcache.plugins.dashboard import Dashboard
from lpcache.workloads.harness import REPO, ServerThread

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
NETWORK = {"http", "https", "ws", "wss", "ftp"}
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"
pytestmark = pytest.mark.browser(CHROMIUM, CHROMEDRIVER)


def browser(profile: Path) -> Any:
    """Headless Chromium with its console and network logs kept; fails the test when anything is missing."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"the browser test needs {', '.join(missing)}: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"the browser test needs selenium: {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                "--disable-default-apps", "--disable-sync", "--no-default-browser-check", "--mute-audio",
                "--window-size=1440,1200", "--force-device-scale-factor=1", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def feed(plugin: Dashboard, now: float) -> tuple[int, int]:
    """Requests spread over the last ten minutes: (all of them, those of the last 30 seconds)."""
    total = recent = 0
    for i in range(48):
        started = now - 600 + i * 11 if i < 40 else now - 12 + (i - 40)   # 40 old ones, 8 in the last 12 s
        status = 500 if i % 13 == 5 else 429 if i % 17 == 3 else 200
        prompt = 600 + (i * 37) % 900
        cached = prompt * (i % 4) // 4
        plugin.finished(RequestRecord(
            path="/v1/chat/completions", api="chat", status=status, started=started, model="smollm2",
            stream=i % 2 == 0,
            backend="http://10.0.0.5:8080" if i % 3 else "http://10.0.0.6:8080", slot=i % 4,
            restored=True if i % 9 == 4 else None, cache_hit=cached > 0, saved=True if i % 5 == 0 else None,
            restore_ms=42.0 if i % 9 == 4 else None, save_ms=18.5 if i % 5 == 0 else None,
            reason=None if status < 400 else "backend_error", prompt_tokens=prompt, cached_tokens=cached,
            prompt_n=prompt - cached, completion_tokens=32 + i % 50, elapsed_ms=350.0 + 13 * i,
            ttft_ms=40.0 + i))
        total += 1
        recent += started >= now - 30
    return total, recent


def proxy_state() -> dict[str, Any]:
    return {
        "in_flight": 2, "waiting": 0, "coalesced_groups": 1, "meta_entries": 17, "cache_disk_bytes": 734_003_200,
        "backends": [
            {"url": "http://10.0.0.5:8080", "state": "closed", "failures": 0, "kv_cache": True, "n_slots": 4,
             "slots": [{"id": i, "busy": i < 2, "used": True} for i in range(4)]},
            {"url": "http://10.0.0.6:8080", "state": "open", "failures": 3, "retry_in_s": 4.0, "kv_cache": True,
             "n_slots": 4, "slots": [{"id": i, "busy": False, "used": i == 0} for i in range(4)]},
        ],
    }


def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    plugin = Dashboard({"refresh_ms": 200})
    plugin.state = proxy_state
    total, last_30s = feed(plugin, time.time())
    assert 0 < last_30s < total
    server = ServerThread(Starlette(routes=list(plugin.routes()))).start()
    driver = None
    try:
        driver = browser(tmp_path / "profile")
        wait = WebDriverWait(driver, 20)

        def text(element_id: str) -> str:
            return str(driver.find_element(By.ID, element_id).text)

        def rows() -> int:
            return int(driver.execute_script(
                "return document.querySelectorAll('#recent-body tr:not(.steps)').length"))

        driver.get_log("performance")   # drop what the browser did before the page (its new-tab page)
        driver.get(server.url + "/dashboard")
        wait.until(lambda d: text("kpi-requests") == str(total))
        assert text("kpi-disk") == "700.0 MiB"
        assert "10.0.0.6:8080" in text("backends") and "open" in text("backends")
        assert rows() == total
        for chart in ("chart-requests", "chart-tokens"):   # read in one go: every poll redraws the bars
            heights = driver.execute_script(
                "return [...document.querySelectorAll(arguments[0])].map(r => Number(r.getAttribute('height')))",
                f"#{chart} rect.bar")
            assert heights and max(heights) > 0, chart
        # Every chart has its axes, scaled to the biggest value the stats API gives for the range shown.
        def series() -> list[dict[str, Any]]:
            return list(httpx.get(server.url + "/dashboard/api/stats", params={"since": 0}).json()["range"]["series"])

        check_charts(driver, series)
        check_cards(driver, httpx.get(server.url + "/dashboard/api/stats").json()["lifetime"])

        # A request finishing now shows at the next poll.
        plugin.finished(RequestRecord(path="/v1/models", method="GET", status=200, started=time.time()))
        total, last_30s = total + 1, last_30s + 1
        wait.until(lambda d: text("kpi-requests") == str(total))
        # A request's time opens its steps (from its record; the trace id when tracing is on).
        started = time.time()
        t0 = round(started * 1e9)
        plugin.finished(RequestRecord(path="/v1/chat/completions", status=200, started=started, elapsed_ms=900.0,
                                      trace_id="4bf92f3577b34da6a3ce929d0e0e4736", steps=[
                                          Step("slot_wait", t0 + 1_000_000, t0 + 6_000_000),
                                          Step("llama_server", t0 + 10_000_000, t0 + 880_000_000)]))
        total, last_30s = total + 1, last_30s + 1
        wait.until(lambda d: text("kpi-requests") == str(total))
        # (every poll draws the table anew: each look and the click are one script, between two draws)
        toggle = "document.querySelector('#recent-body tr:first-child button.steps-toggle')"
        wait.until(lambda d: d.execute_script(f"const b = {toggle}; return b && [b.textContent, "
                                              "b.getAttribute('aria-expanded')]") == ["900", "false"])
        driver.execute_script(f"{toggle}.click()")
        shown = wait.until(lambda d: d.execute_script(
            "const r = document.querySelector('#recent-body tr.steps'); return r && !r.hidden && r.textContent"))
        assert "slot_wait +1 ms: 5 ms" in shown and "llama_server +10 ms: 870 ms" in shown, shown
        assert "trace 4bf92f3577b34da6a3ce929d0e0e4736" in shown

        # The time filter scopes the cards and the recent table.
        Select(driver.find_element(By.ID, "range")).select_by_visible_text("30 seconds")
        wait.until(lambda d: text("kpi-requests") == str(last_30s))
        wait.until(lambda d: rows() == last_30s)
        # A custom time (two minutes ago: after the old requests, before the new ones) in the datetime input.
        Select(driver.find_element(By.ID, "range")).select_by_visible_text("custom time")
        wait.until(lambda d: d.find_element(By.ID, "range-custom").is_displayed())
        wait.until(lambda d: text("kpi-requests") == str(total))   # the input starts an hour ago
        driver.execute_script("""
            const input = document.getElementById('range-custom'), d = new Date(Date.now() - 120000);
            d.setMinutes(d.getMinutes() - d.getTimezoneOffset());
            input.value = d.toISOString().slice(0, 19);
            input.dispatchEvent(new Event('change'));""")
        wait.until(lambda d: text("kpi-requests") == str(last_30s) and rows() == last_30s)
        Select(driver.find_element(By.ID, "range")).select_by_visible_text("all time")
        wait.until(lambda d: text("kpi-requests") == str(total) and rows() == total)

        # No errors in the console, and nothing fetched from anywhere but the test server.
        severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert severe == [], severe
        resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(name.startswith(server.url + "/") for name in resources), resources
        urls = []
        for entry in driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                urls.append(message["params"]["request"]["url"])
        assert any(url.startswith(server.url + "/dashboard/api/stats") for url in urls), urls
        # (chrome://, data: and the like are the browser's own, never the network: its start-up tab loads them)
        strays = [url for url in urls if url.split(":", 1)[0] in NETWORK and not url.startswith(server.url + "/")]
        assert strays == [], strays
    finally:
        if driver is not None:
            driver.quit()
        server.stop()
    # The page's own polling never counted.
    assert plugin.stats()["lifetime"]["requests"] == total


# ---- the charts' axes, against the stats API ----

PLOT_HEIGHT = 200 - 10 - 22      # the page's chart: 200 px, 10 above the plot, 22 below it


def _largest(values: Any) -> float:
    return max([v for v in values if v is not None], default=0.0)


def _backends(p: dict[str, Any], key: str) -> list[float]:
    return [b[key] for b in p["backends"].values()]


# What each chart shows of a series point: a stack of bars (its total is what counts) or lines (each value).
CHARTS: dict[str, Any] = {
    "chart-requests": lambda p: (p["served"] + p["client_errors"] + p["server_errors"]) / p["secs"],
    "chart-success": lambda p: p["success_rate"],
    "chart-prompt": lambda p: (p["cached_tokens"] + p["computed_tokens"]) / p["secs"],
    "chart-tokens": lambda p: p["tok_per_s"],
    "chart-ttft": lambda p: _largest([p["ttft_p50"], p["ttft_p90"], p["ttft_p99"]]),
    "chart-latency": lambda p: _largest([p["latency_p50"], p["latency_p90"], p["latency_p99"]]),
    "chart-backend-requests": lambda p: sum(_backends(p, "req_per_s")),
    "chart-backend-busy": lambda p: _largest(_backends(p, "busy")),
}

READ_CHARTS = """
    const out = {};
    for (const id of arguments[0]) {
        const el = document.getElementById(id);
        const nums = (sel, attr) => [...el.querySelectorAll(sel)].map(e => Number(e.getAttribute(attr)));
        out[id] = {max: Number(el.dataset.max), top: Number(el.dataset.top), step: Number(el.dataset.step),
                   points: Number(el.dataset.points), yticks: nums("text.ytick", "data-v"),
                   labels: [...el.querySelectorAll("text.ytick")].map(e => e.textContent),
                   xticks: el.querySelectorAll("text.xtick").length, grid: el.querySelectorAll("line.grid").length,
                   axes: el.querySelectorAll("line.axis").length,
                   bars: [...el.querySelectorAll("rect.bar")].map(r => [Number(r.getAttribute("height")),
                                                                         Number(r.dataset.v)]),
                   dots: nums("circle.dot", "data-v"), lines: el.querySelectorAll("path.line").length};
    }
    return out;"""


def check_charts(driver: Any, fetch: Any) -> None:
    """Each chart: its biggest value is the API's, the y axis goes from 0 to the round number just at or above it
    in steps of 1, 2, 2.5 or 5 x 10^k with a label and a gridline each, time ticks below, and bars as tall as
    their value on that axis. `fetch()` gives the API's series of the range the page shows; the page and the API
    are compared until they are read between the same two polls (a new bucket may start in between)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    failure: list[AssertionError] = []

    def matches(_: Any) -> bool:
        series = fetch()
        try:
            compare_charts(driver.execute_script(READ_CHARTS, list(CHARTS)), series)
        except AssertionError as e:
            failure[:] = [e]
            return False
        return True

    try:
        WebDriverWait(driver, 20, poll_frequency=0.1).until(matches)
    except TimeoutException:
        raise failure[0] from None


def compare_charts(charts: dict[str, Any], series: list[dict[str, Any]]) -> None:
    import math

    for chart, value in CHARTS.items():
        got = charts[chart]
        expected = max([v for v in map(value, series) if v is not None], default=0.0)
        assert got["points"] == len(series), chart
        assert got["max"] == pytest.approx(expected, rel=1e-6, abs=1e-9), chart
        step, top = got["step"], got["top"]
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert any(mantissa == pytest.approx(m) for m in (1, 2, 2.5, 5)), (chart, step)
        if expected > 0:
            assert top >= expected - 1e-9 and top - step < expected, (chart, top, step, expected)
        assert got["yticks"] == pytest.approx([i * step for i in range(round(top / step) + 1)]), chart
        assert all(got["labels"]), chart
        assert got["axes"] == 2 and got["xticks"] >= 2 and got["grid"] >= len(got["yticks"]) - 1 + got["xticks"]
        for height, v in got["bars"]:
            assert height == pytest.approx(v / top * PLOT_HEIGHT, abs=0.02), chart
        if got["bars"]:
            assert max(h for h, _ in got["bars"]) > 0
        if chart in ("chart-ttft", "chart-latency", "chart-success", "chart-backend-busy"):
            assert got["lines"] >= 1 and (not expected or max(got["dots"]) == pytest.approx(expected)), chart


def check_cards(driver: Any, counters: dict[str, Any]) -> None:
    """The cards show the API's counters: the success rate without the clients' errors, those apart, TTFT and
    latency percentiles."""
    def value(element_id: str) -> str:
        return str(driver.execute_script("return document.getElementById(arguments[0]).dataset.value", element_id))

    assert value("kpi-requests") == str(counters["requests"])
    assert float(value("kpi-success-rate")) == pytest.approx(counters["success_rate"])
    assert value("kpi-client-errors") == str(counters["client_errors"])
    assert counters["ttft_ms"]["n"] > 0 and counters["latency_ms"]["n"] > 0
    assert float(value("kpi-ttft")) == pytest.approx(counters["ttft_ms"]["p50"])
    assert float(value("kpi-latency")) == pytest.approx(counters["latency_ms"]["p50"])
    # the clients' 4xx do not lower the rate shown
    assert counters["client_errors"] > 0 and counters["success_rate"] > counters["successes"] / counters["requests"]
    assert counters["success_rate"] == pytest.approx(counters["served"] / (counters["served"] +
                                                                          counters["server_errors"]))


# ---- client keys: the login form, then the page ----

KEY = "dashboard-test-key-7f3a"
BACKEND_SLOTS = 2


def feed_realistic(plugin: Dashboard, now: float, backends: list[str], model: str, minutes: int = 20,
                   seed: int = 7) -> int:
    """Simulated traffic of the last `minutes`: conversations that come back (resident hits, restores) and new
    ones (misses), big and small prompts, streams and JSON, a few 4xx and 5xx, on `backends` of BACKEND_SLOTS slots
    each (a request waits for its slot, holds it for its prefill and generation). Returns how many it fed."""
    import random

    rng = random.Random(seed)
    free = [[0.0] * BACKEND_SLOTS for _ in backends]    # when each slot frees
    t, n = now - minutes * 60, 0
    conversations: list[dict[str, Any]] = []
    while True:
        busier = 2.0 if int((now - t) // 170) % 3 == 0 else 1.0   # a busier stretch every few minutes
        t += rng.expovariate(0.2 * busier)
        if t >= now - 5:
            return n
        big = rng.random() < 0.35
        if conversations and rng.random() < 0.6:
            conv = rng.choice(conversations)
        else:
            conv = {"len": rng.randint(1500, 7000) if big else rng.randint(60, 500), "b": rng.randrange(len(backends))}
            conversations = [*conversations[-11:], conv]
        prompt = conv["len"] + rng.randint(20, 300)
        seen = conv.get("seen", False)
        restored = seen and conv["len"] > 1500 and rng.random() < 0.3
        cached = conv["len"] if seen and rng.random() < 0.85 else 0
        conv["seen"], conv["len"] = True, prompt
        status, reason, r = 200, None, rng.random()
        if r < 0.03:
            status, reason = rng.choice([400, 422, 401]), "invalid_request"
        elif r < 0.045:
            status, reason = rng.choice([502, 503]), rng.choice(["backend_unreachable", "slot_timeout"])
        b = conv["b"]
        slot = min(range(BACKEND_SLOTS), key=lambda i: free[b][i])
        wait = max(0.0, free[b][slot] - t)
        computed = prompt - cached
        restore_ms = rng.uniform(120, 600) if restored else None
        prefill_ms = computed / rng.uniform(900, 1400) * 1000 + 15
        ok = status == 200
        completion = rng.randint(20, 250) if ok else None
        gen_ms = completion / rng.uniform(35, 60) * 1000 if completion else None
        stream = rng.random() < 0.75
        if status < 400:
            elapsed = wait * 1000 + (restore_ms or 0) + prefill_ms + (gen_ms or 0) + rng.uniform(3, 20)
        else:
            elapsed = rng.uniform(1, 6) if status < 500 else rng.uniform(30, 2500)
        if t + elapsed / 1000 > now - 1:
            continue                                   # still running: no record yet
        if status < 400:
            free[b][slot] = t + elapsed / 1000
        plugin.finished(RequestRecord(
            path="/v1/chat/completions", api="chat", status=status, reason=reason, started=t, model=model,
            stream=stream, backend=backends[b] if status < 400 or status >= 500 else None,
            slot=slot if ok else None, restored=True if restored and ok else None,
            cache_hit=cached > 0 if ok else None, saved=True if big and ok and rng.random() < 0.7 else None,
            restore_ms=restore_ms if ok else None, save_ms=rng.uniform(40, 200) if big and ok else None,
            restore_bytes=cached * 57_344 if restored and ok else None,   # a 7B model's KV cache per token
            save_bytes=prompt * 57_344 if big and ok else None,
            prompt_tokens=prompt if ok else None, cached_tokens=cached if ok else None,
            prompt_n=computed if ok else None, completion_tokens=completion,
            prefill_ms=prefill_ms if ok else None, gen_ms=gen_ms, elapsed_ms=elapsed,
            ttft_ms=wait * 1000 + (restore_ms or 0) + prefill_ms + rng.uniform(5, 25) if stream and ok else None,
            route=("restore" if restored else "resident" if cached else "prefill") if ok else None))
        n += 1


def real_traffic(url: str) -> int:
    """Requests through lpcache and the stand-ins: two long conversations (a miss, then hits), short JSON and
    streams, a body that is not JSON, one without a key, and a backend's 500. Returns how many."""
    import httpx

    from ..conftest import user, words

    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
        def chat(text: str, **body: Any) -> int:
            return http.post("/v1/chat/completions", json={"messages": user(text), **body}).status_code

        for seed in (1, 2):
            first = words(seed, 300)
            assert chat(first, stream=True) == 200
            assert chat(first + " and one more question", stream=True) == 200
        assert chat(words(3, 20)) == 200 and chat(words(4, 20), stream=True) == 200
        assert http.post("/v1/chat/completions", content=b"{oops").status_code == 422
        assert httpx.post(url + "/v1/chat/completions", json={"messages": user("hi")}).status_code == 401
        return 8


def test_with_client_keys_the_browser_signs_in_and_sees_the_history(tmp_path: Path, start_backend: Any,
                                                                     start_proxy: Any) -> None:
    """A proxy restarted with client keys: its history file (twenty minutes of simulated traffic) is read at
    start, real requests add to it, the page first asks for a key (401), takes a wrong one back, and with the
    right one shows the data; the key in the URL works too, and leaves the address bar. With LPCACHE_SCREENSHOT=1
    it writes docs/dashboard.png."""
    import asyncio

    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from lpcache.config import Settings

    backends = [start_backend(prefill_ms_per_token=0.2, gen_ms_per_token=3) for _ in range(2)]
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    spec = {"name": "dashboard", "params": {"refresh_ms": 300}}
    earlier = Dashboard(spec["params"])         # the proxy before its restart, which kept its history an hour
    earlier.since, earlier.history_path = time.time() - 3600, str(meta_dir / "dashboard-history.json")
    fed = feed_realistic(earlier, time.time(), [b.url for b in backends], Settings().model_id)
    assert asyncio.run(earlier.save())
    assert fed > 150 and (meta_dir / "dashboard-history.json").is_file()

    proxy = start_proxy(*backends, plugins=(spec,), api_keys=(KEY,), meta_dir=str(meta_dir))
    real = real_traffic(proxy.url)
    proxy.wait_finished(real - 1)                # the request without a key is refused before any route
    auth = {"authorization": f"Bearer {KEY}"}
    stats = httpx.get(proxy.url + "/dashboard/api/stats", params={"since": 0}, headers=auth).json()
    assert stats["lifetime"]["requests"] == fed + real - 1
    assert stats["lifetime"]["server_errors"] > 0 and stats["lifetime"]["client_errors"] > 0

    driver = None
    try:
        driver = browser(tmp_path / "profile")
        wait = WebDriverWait(driver, 30)

        def text(element_id: str) -> str:
            return str(driver.find_element(By.ID, element_id).text)

        driver.get_log("performance")
        driver.get(proxy.url + "/dashboard")
        wait.until(lambda d: d.find_elements(By.ID, "login"))
        statuses = [json.loads(e["message"])["message"]["params"]["response"]["status"]
                    for e in driver.get_log("performance")
                    if json.loads(e["message"])["message"]["method"] == "Network.responseReceived"
                    and json.loads(e["message"])["message"]["params"]["response"]["url"] == proxy.url + "/dashboard"]
        assert statuses == [401]
        assert driver.get_cookies() == []
        driver.find_element(By.ID, "key").send_keys("not-the-key")
        driver.find_element(By.ID, "sign-in").click()
        wait.until(lambda d: d.find_elements(By.ID, "login-error"))
        assert driver.get_cookies() == []
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "sign-in").click()
        wait.until(lambda d: text("kpi-requests") == f"{fed + real - 1:,}")
        assert driver.current_url == proxy.url + "/dashboard"
        (cookie,) = driver.get_cookies()
        assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict" and cookie["path"] == "/dashboard"
        assert KEY not in cookie["value"] and driver.execute_script("return document.cookie") == ""
        wait.until(lambda d: text("history-since").startswith("history since"))
        def series() -> list[dict[str, Any]]:
            doc = httpx.get(proxy.url + "/dashboard/api/stats", params={"since": 0}, headers=auth).json()
            return list(doc["range"]["series"])

        check_charts(driver, series)
        check_cards(driver, httpx.get(proxy.url + "/dashboard/api/stats", headers=auth).json()["lifetime"])
        assert "127.0.0.1" in text("backends") and "closed" in text("backends")

        Select(driver.find_element(By.ID, "range")).select_by_visible_text("15 minutes")
        wait.until(lambda d: d.execute_script("return document.getElementById('chart-ttft').dataset.points")
                   == "180")
        if os.environ.get("LPCACHE_SCREENSHOT") == "1":
            driver.set_window_size(1440, 1980)
            wait.until(lambda d: d.execute_script("return document.getElementById('chart-ttft').clientWidth")
                       > 600)
            status_before = text("status")
            wait.until(lambda d: text("status") != status_before)    # a poll drew it at this size
            shot = REPO / "docs" / "dashboard.png"
            assert driver.save_screenshot(str(shot))

        # The key once in the URL: exchanged for the cookie, gone from the address bar.
        driver.delete_all_cookies()
        driver.get(proxy.url + "/dashboard?key=" + KEY)
        wait.until(lambda d: text("kpi-requests") == f"{fed + real - 1:,}")
        assert driver.current_url == proxy.url + "/dashboard" and len(driver.get_cookies()) == 1
        severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"
                  and "401" not in entry["message"]]   # the login form's own 401s
        assert severe == [], severe
        resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(name.startswith(proxy.url + "/") for name in resources), resources
    finally:
        if driver is not None:
            driver.quit()
