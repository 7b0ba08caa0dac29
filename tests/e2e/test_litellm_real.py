"""lpcache's LiteLLM hook in a real LiteLLM proxy (litellm[proxy] 1.108.7, its own virtualenv) in front of a real
llama-server with one slot (-np 1 --cache-ram 0): the session workload of tests/e2e/test_sessions_real.py, sent to
LiteLLM with X-Session-ID, computes at most 1.05 times the ideal. LiteLLM does not pass llama-server's `timings`
on, so the tokens the server computed are read from its own /metrics (`llamacpp:prompt_tokens_total`)."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import httpx
import pytest

from lpcache.backends.backend import model_fingerprint
from lpcache.cache.sessions import route_tag
from lpcache.workloads.harness import LlamaServer
from lpcache.workloads.story import ideal, turns

from ..conftest import figures
from .litellm_rig import LiteLLMProxy, route

pytestmark = pytest.mark.e2e

BOUND = 1.05


def prompt_tokens_total(server: LlamaServer) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    match = re.search(r"^llamacpp:prompt_tokens_total\s+([0-9.e+]+)$", text, re.MULTILINE)
    assert match, text[:500]
    return int(float(match.group(1)))


def test_session_workload_through_litellm_computes_about_the_ideal(tmp_path: Any) -> None:
    workload = turns(users=3, kinds=("generate", "annotate", "redraft"), rounds=4)
    slots = str(tmp_path / "slots")
    with LlamaServer(slots, n_slots=1, cache_ram=0, ctx=4096, extra=["--metrics"]) as server:
        ideal_total = sum(ideal(server.url, workload))
        model_list = [route("*", "openai/*", f"{server.url}/v1", model_info={"slot_cache": {"save_path": slots}})]
        with LiteLLMProxy(model_list, callbacks="lpcache.integrations.litellm.proxy_handler_instance",
                          env={"LITELLM_LOG": "INFO"}) as proxy:
            before = prompt_tokens_total(server)
            started = time.perf_counter()
            with httpx.Client(timeout=600, headers=proxy.headers) as client:
                for t in workload:
                    r = client.post(f"{proxy.url}/v1/chat/completions", headers={"X-Session-ID": t.session},
                                    json={"model": "smollm2", "messages": t.messages, "max_tokens": 8,
                                          "temperature": 0})
                    assert r.status_code == 200, r.text
            seconds = time.perf_counter() - started
            computed = prompt_tokens_total(server) - before
            restores = proxy.log_lines("slot_restore")
            lines = proxy.log_lines("slot_")
        names = os.listdir(slots)
        props = httpx.get(f"{server.url}/props", timeout=30).json()
        fingerprint = model_fingerprint(props, httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0])
    figures(f"\nthrough LiteLLM with lpcache's hook: computed {computed}, ideal {ideal_total} "
          f"({computed / ideal_total:.3f}x), {len([x for x in restores if ': ok' in x])} restores, "
          f"{len(names)} files, {seconds:.0f} s")
    assert any("slot_restore" in line and ": ok" in line for line in lines), "\n".join(lines[-20:])
    assert computed <= BOUND * ideal_total
    assert len(names) == 3 * 3 and all(n.startswith(route_tag("smollm2", fingerprint)) for n in names)
