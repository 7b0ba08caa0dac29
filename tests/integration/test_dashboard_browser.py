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

from lpcache.plugins.dashboard import Dashboard
from lpcache.record import RequestRecord
from lpcache.testing import REPO, ServerThread

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
            path="/v1/chat/completions", status=status, started=started, model="smollm2", stream=i % 2 == 0,
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
            return int(driver.execute_script("return document.querySelectorAll('#recent-body tr').length"))

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

        # A request finishing now shows at the next poll.
        plugin.finished(RequestRecord(path="/v1/models", method="GET", status=200, started=time.time()))
        total, last_30s = total + 1, last_30s + 1
        wait.until(lambda d: text("kpi-requests") == str(total))

        if os.environ.get("LPCACHE_SCREENSHOT") == "1":
            shot = REPO / "docs" / "dashboard.png"
            shot.parent.mkdir(exist_ok=True)
            assert driver.save_screenshot(str(shot))

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
