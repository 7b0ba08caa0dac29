"""The demo: lpcache in front of a real llama-server, showing a restore and the prefill it saved.

    python -m lpcache.workloads.demo          (or: make demo, which also does the set-up)

A long conversation, two other long conversations that take both slots, then the first conversation again: through
lpcache its cache comes back from disk; straight to llama-server (RAM prompt cache off, --cache-ram 0) the whole
prompt is computed again. The same run is sent both ways and the figures are printed side by side.

lpcache runs with BIG_THRESHOLD_WORDS=auto, as the quick start advises on a CPU: it saves a cache when the prefill it
spares beats writing and reading it, at the speeds it measures (the demo prints its verdict).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

from lpcache.workloads.harness import ChatResult, LlamaServer, LpcacheProcess, chat, llama_paths, story

SYSTEM = {"role": "system", "content": "You are a careful reader. Answer briefly."}


def conversation(seed: int, n_words: int) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": story(seed, n_words) + "\nWho is in this story?"}]


def run(url: str, label: str, n_words: int) -> ChatResult:
    """The scenario against one URL; returns the result of the last request (the first conversation again)."""
    first = conversation(1, n_words)
    print(f"  [{label}] conversation A ({n_words} words)...", flush=True)
    answer = chat(url, first, max_tokens=24).text
    for seed, name in ((2, "B"), (3, "C")):
        print(f"  [{label}] conversation {name} ({n_words} words), pushing A out of the slots...", flush=True)
        chat(url, conversation(seed, n_words), max_tokens=24)
    print(f"  [{label}] conversation A again, with one more question...", flush=True)
    again = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Where does it happen?"}]
    return chat(url, again, stream=True, max_tokens=24)


def main(argv: list[str] | None = None) -> int:
    n_words = int((argv if argv is not None else sys.argv[1:] or ["1400"])[0])
    print("lpcache demo: getting llama-server (build 11434) and SmolLM2-135M (cached after the first run)...",
          flush=True)
    llama_paths()
    work = tempfile.mkdtemp(prefix="lpcache-demo-")
    slots, meta = f"{work}/slots", f"{work}/kv_meta"

    print("\n1) lpcache in front of llama-server -np 2 --cache-ram 0 --slot-save-path", slots, flush=True)
    with LlamaServer(slots, n_slots=2, cache_ram=0) as server:
        settings = {"BACKENDS": json.dumps([{"url": server.url, "slot_save_path": slots}]), "META_DIR": meta,
                    "LOG_LEVEL": "INFO", "BIG_THRESHOLD_WORDS": "auto"}
        with LpcacheProcess(settings) as proxy:
            started = time.perf_counter()
            via = run(proxy.url, "lpcache", n_words)
            via_total = time.perf_counter() - started
            log_lines = proxy.log_text().splitlines()
            restores = [line for line in log_lines if "restore_before_chat" in line]
            verdicts = [line for line in log_lines if "save_verdict" in line or "slot_saved" in line]

    print("\n2) the same run straight to a fresh llama-server -np 2 --cache-ram 0", flush=True)
    with LlamaServer(None, n_slots=2, cache_ram=0) as server:
        started = time.perf_counter()
        direct = run(server.url, "llama-server", n_words)
        direct_total = time.perf_counter() - started

    restored = via.headers.get("x-lpcache-restored") == "true"
    rows = [
        ("", "through lpcache", "llama-server alone"),
        ("restored from disk", "yes" if restored else "no", "-"),
        ("prompt tokens (all)", via.cache_n + via.prompt_n, direct.cache_n + direct.prompt_n),
        ("taken from cache (cache_n)", via.cache_n, direct.cache_n),
        ("computed (prompt_n)", via.prompt_n, direct.prompt_n),
        ("time to first token", f"{via.ttft or 0:.2f} s", f"{direct.ttft or 0:.2f} s"),
        ("whole run (4 requests)", f"{via_total:.1f} s", f"{direct_total:.1f} s"),
    ]
    print("\nConversation A, after B and C took both slots:\n")
    for name, a, b in rows:
        print(f"  {name:<28} {a!s:>16} {b!s:>20}")
    if verdicts:
        print("\nlpcache's log (BIG_THRESHOLD_WORDS=auto):")
        for line in verdicts[:3]:
            print("  " + line.split(": ", 1)[-1])
    if restores:
        print("  " + restores[-1].split(": ", 1)[-1])
    saved = direct.prompt_n - via.prompt_n
    print(f"\nPrefill saved by the restore: {saved} tokens "
          f"({(direct.ttft or 0) - (via.ttft or 0):.1f} s sooner to the first token).")
    print(f"Files: {work}")
    return 0 if restored and via.prompt_n < direct.prompt_n else 1


if __name__ == "__main__":
    sys.exit(main())
