"""Plugins through the whole proxy: prefilters before any backend work, the request log, metrics, entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lpcache.config import load_settings
from lpcache.mock_llama.guard_model import create_guard_app
from lpcache.workloads.harness import ServerThread

from ..conftest import user, words
from .conftest import mock_stats

SMALL, BIG = 20, 200


def specs(*items: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    return tuple(items)


def keyword(*kw: str, **params: Any) -> dict[str, Any]:
    return {"name": "keyword", "params": {"keywords": list(kw), **params}}


def meta_count(proxy: Any) -> int:
    d = proxy.settings.meta_dir
    return len([f for f in os.listdir(d) if f.endswith(".meta.json")]) if os.path.isdir(d) else 0


# ---- keyword ----

@pytest.mark.parametrize("messages, stream", [
    (user("please tell me the SECRET plan"), False),                        # case-insensitive by default
    ([{"role": "user", "content": [{"type": "text", "text": "a secret"}]}], False),   # content parts
    (user("the secret " + words(1, BIG)), False),                           # a big request: no slot, no save
    (user("a secret in a stream"), True),
])
def test_keyword_rejects_before_any_backend_work(start_backend: Any, start_proxy: Any, messages: Any,
                                                 stream: bool) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, plugins=specs(keyword("secret")), coalesce_requests=True)
    r = proxy.client.post("/v1/chat/completions", json={"messages": messages, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prefilter_rejected"
    assert "secret" not in r.json()["error"]["message"].lower()
    proxy.wait_finished(1)
    assert proxy.records[0].reason == "prefilter_reject"
    stats = mock_stats(backend)
    assert stats["chat_requests"] == 0 and stats["saves"] == 0 and stats["restores"] == 0
    assert meta_count(proxy) == 0 and proxy.busy_slots() == [] and len(proxy.pipeline.coalescer) == 0


def test_keyword_case_sensitive_and_accepting(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, plugins=specs(keyword("Secret", case_insensitive=False)))
    assert proxy.chat(user("a secret")).status_code == 200
    assert proxy.chat(user("a Secret")).status_code == 400
    assert mock_stats(backend)["chat_requests"] == 1


def test_rejected_requests_never_join_a_coalescing_group(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend(gen_ms_per_token=20)
    proxy = start_proxy(backend, plugins=specs(keyword("forbidden")), coalesce_requests=True)
    body = {"messages": user("forbidden words"), "max_tokens": 20}
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: proxy.client.post("/v1/chat/completions", json=body).status_code, range(6)))
    assert codes == [400] * 6 and mock_stats(backend)["chat_requests"] == 0
    assert all(rec.coalesced is None for rec in proxy.records)


def test_legacy_prefilter_variables(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    settings = load_settings([], {"PREFILTER_BLOCKLIST": "alpha, beta", "PREFILTER_RESULT_CACHE_DIR": str(tmp_path),
                                  "PREFILTER_RESULT_CACHE_TTL": "0"})
    assert [s["name"] for s in settings.plugins] == ["keyword", "result_cache"]
    with_plugins = load_settings([], {"PREFILTER_BLOCKLIST": "alpha", "PLUGINS": "[]"})
    assert with_plugins.plugins == ()       # PLUGINS wins, even empty
    backend = start_backend()
    proxy = start_proxy(backend, plugins=settings.plugins)
    assert proxy.chat(user("BETA")).status_code == 400
    assert proxy.chat(user("gamma")).status_code == 200
    proxy.settle()                                          # the answer is stored after it was sent
    assert proxy.chat(user("gamma")).status_code == 200     # answered from the result cache
    assert mock_stats(backend)["chat_requests"] == 1


# ---- result_cache ----

def result_cache(tmp_path: Path, **params: Any) -> dict[str, Any]:
    return {"name": "result_cache", "params": {"dir": str(tmp_path / "results"), **params}}


def test_result_cache_serves_then_expires(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, plugins=specs(result_cache(tmp_path, ttl_secs=1000)))
    first = proxy.chat(user(words(1, SMALL)), temperature=0)
    proxy.settle()
    second = proxy.chat(user(words(1, SMALL)), temperature=0)
    assert second.headers.get("x-lpcache-served-by") == "prefilter"
    assert second.json()["choices"] == first.json()["choices"]
    assert mock_stats(backend)["chat_requests"] == 1
    assert proxy.chat(user(words(1, SMALL)), temperature=0.5).status_code == 200   # other parameters: a miss
    assert mock_stats(backend)["chat_requests"] == 2
    plugin = proxy.pipeline.prefilters[0]
    plugin.clock = lambda: time.time() + 2000   # type: ignore[attr-defined]
    proxy.chat(user(words(1, SMALL)), temperature=0)
    assert mock_stats(backend)["chat_requests"] == 3


def test_result_cache_one_shot_and_no_cache(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, plugins=specs(result_cache(tmp_path, remove_after_serve=True, cache_control=True)))
    proxy.chat(user(words(2, SMALL)))
    proxy.settle()
    bypass = proxy.client.post("/v1/chat/completions", json={"messages": user(words(2, SMALL))},
                               headers={"Cache-Control": "no-cache"})
    assert bypass.headers.get("x-lpcache-served-by") is None
    proxy.settle()
    assert proxy.chat(user(words(2, SMALL))).headers.get("x-lpcache-served-by") == "prefilter"
    proxy.settle()
    assert proxy.chat(user(words(2, SMALL))).headers.get("x-lpcache-served-by") is None   # removed after serving
    assert mock_stats(backend)["chat_requests"] == 3


def test_result_cache_streaming(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    backend = start_backend()
    proxy = start_proxy(backend, plugins=specs(result_cache(tmp_path, cache_streaming=True)))
    body = {"messages": user(words(3, SMALL)), "stream": True, "max_tokens": 6}
    first = proxy.client.post("/v1/chat/completions", json=body)
    proxy.settle()
    again = proxy.client.post("/v1/chat/completions", json=body)
    assert again.headers.get("x-lpcache-served-by") == "prefilter"
    assert again.headers["content-type"].startswith("text/event-stream") and again.text.endswith("data: [DONE]\n\n")

    def text(raw: str) -> str:
        return "".join((c.get("delta") or {}).get("content") or "" for line in raw.split("\n")
                       if line.startswith("data: {") for c in json.loads(line[6:]).get("choices") or [])

    assert text(again.text) == text(first.text)
    assert mock_stats(backend)["chat_requests"] == 1


# ---- qwen_guard over HTTP ----

def test_qwen_guard_rejects_unsafe_requests(start_backend: Any, start_proxy: Any) -> None:
    backend = start_backend()
    with ServerThread(create_guard_app({"weapon": ("Unsafe", ["Violent"])})) as guard:
        proxy = start_proxy(backend, plugins=specs({"name": "qwen_guard", "params": {"url": guard.url}}))
        assert proxy.chat(user("how to build a weapon")).status_code == 400
        assert proxy.chat(user("how to bake bread")).status_code == 200
    assert mock_stats(backend)["chat_requests"] == 1


# ---- request log, metrics ----

def test_request_log_records_every_finished_request(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "logs" / "req.log"
    backend = start_backend()
    proxy = start_proxy(backend, plugins=specs(keyword("nope"), {"name": "request_log", "params": {
        "path": str(log_path)}}))
    proxy.chat(user(words(1, BIG)))
    proxy.chat(user("nope"))
    proxy.client.post("/v1/chat/completions", content=b"{bad")
    with proxy.client.stream("POST", "/v1/chat/completions",
                             json={"messages": user(words(2, SMALL)), "stream": True, "max_tokens": 3}) as r:
        r.read()
    proxy.client.get("/props")
    proxy.wait_finished(5)
    lines = log_path.read_text().splitlines()
    assert lines[0].startswith("#Software: lpcache-plugins/") and lines[1] == "#Version: 1.0"
    fields = lines[3].removeprefix("#Fields: ").split()
    assert len(fields) == 28 and fields[0] == "datetime" and fields[-1] == "lpcache-ttft-ms"
    rows = [line.split(" ") for line in lines[4:]]
    assert len(rows) == 5
    col = {name: i for i, name in enumerate(fields)}
    # (written as requests finish: the big one after its save, so not in the order sent)
    [big] = [r for r in rows if r[col["lpcache-is-big"]] == "true"]
    assert big[col["sc-status"]] == "200" and big[col["lpcache-saved" if "lpcache-saved" in col else "sc-status"]]
    assert int(big[col["lpcache-prompt-tokens"]]) > BIG and big[col["lpcache-prefill-ms"]] != "-"
    [rejected] = [r for r in rows if r[col["lpcache-reason"]] == "prefilter_reject"]
    assert rejected[col["sc-status"]] == "400"
    assert [r[col["sc-status"]] for r in rows].count("422") == 1
    [streamed] = [r for r in rows if r[col["lpcache-stream"]] == "true"]
    assert streamed[col["lpcache-ttft-ms"]] != "-" and streamed[col["sc-status"]] == "200"
    assert [r[col["cs-uri"]] for r in rows].count("/props") == 1


def test_metrics(start_backend: Any, start_proxy: Any) -> None:
    proxy = start_proxy(start_backend())
    proxy.chat(user(words(1, BIG)))
    proxy.wait_finished(1)
    text = proxy.client.get("/metrics").text
    assert 'lpcache_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'lpcache_saves_total{result="ok"} 1.0' in text
    assert "lpcache_prompt_tokens_total" in text and "lpcache_slots_busy" in text
    assert 'lpcache_backend_circuit_state{backend="' in text


def test_prefilter_outcomes_in_metrics(start_backend: Any, start_proxy: Any) -> None:
    proxy = start_proxy(start_backend(), plugins=specs(keyword("nope")))
    proxy.chat(user("nope"))
    proxy.chat(user("nope"))
    proxy.wait_finished(2)
    assert 'lpcache_prefilter_outcomes_total{outcome="reject",plugin="keyword"} 2.0' in \
        proxy.client.get("/metrics").text


# ---- start-up errors, third-party plugins ----

@pytest.mark.parametrize("plugins, fragment", [
    ('[{"name": "nosuch"}]', "unknown plugin 'nosuch'"),
    ('[{"name": "keyword", "params": {"keywords": []}}]', "keyword"),
    ('[{"name": "dashboard"}, {"name": "dashboard"}]', "only once"),
    ('{"name": "keyword"}', "PLUGINS"),
])
def test_bad_plugin_specs_stop_start_up(plugins: str, fragment: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lpcache", "--plugins", plugins], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "PLUGINS" in line and fragment in line


def test_a_plugin_package_is_found_through_its_entry_point(start_backend: Any, start_proxy: Any,
                                                           tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "shout_filter").mkdir(parents=True)
    (src / "shout_filter" / "__init__.py").write_text(textwrap.dedent('''
        from lpcache.plugins import Prefilter, Reject

        class ShoutFilter(Prefilter):
            name = "no_shouting"

            def __init__(self, params):
                super().__init__(params)
                self.limit = int(params.get("limit", 3))

            async def check(self, request):
                if sum(1 for w in request.text.split() if w.isupper() and len(w) > 1) >= self.limit:
                    return Reject("please do not shout", code="shouting")
                return None
    '''))
    (src / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "shout-filter"
        version = "1.0"
        [project.entry-points."lpcache.plugins"]
        no_shouting = "shout_filter:ShoutFilter"
        [tool.setuptools]
        packages = ["shout_filter"]
    '''))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), str(src)], check=True, timeout=300)
    sys.path.insert(0, str(target))
    try:
        backend = start_backend()
        proxy = start_proxy(backend, plugins=specs({"name": "no_shouting", "params": {"limit": 2}}))
        r = proxy.chat(user("STOP DOING THAT"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "shouting"
        assert proxy.chat(user("calm words")).status_code == 200
    finally:
        sys.path.remove(str(target))


def test_dashboard_through_the_proxy(start_backend: Any, start_proxy: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "req.log"
    proxy = start_proxy(start_backend(), plugins=specs({"name": "dashboard", "params": {"path": "/dash"}},
                                                       {"name": "request_log", "params": {"path": str(log_path)}}))
    proxy.chat(user(words(1, BIG)))
    proxy.wait_finished(1)
    page = proxy.client.get("/dash")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    stats = proxy.client.get("/dash/api/stats").json()
    assert stats["lifetime"]["requests"] == 1 and stats["lifetime"]["saves_ok"] == 1
    assert stats["proxy"]["meta_entries"] == 1 and stats["proxy"]["backends"][0]["n_slots"] == 2
    assert stats["proxy"]["cache_disk_bytes"] > 0
    assert stats["lifetime"]["save_bytes"] == stats["proxy"]["cache_disk_bytes"]   # the one file it wrote
    proxy.client.get("/dash/api/stats?since=0")
    assert proxy.client.get("/dash/api/stats").json()["lifetime"]["requests"] == 1   # its own polls not counted
    rows = [line for line in log_path.read_text().splitlines() if not line.startswith("#")]
    assert len(rows) == 1 and "/dash" not in rows[0]
