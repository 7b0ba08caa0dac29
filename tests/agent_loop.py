"""A scripted agent session for the tests of the agent APIs: one harness (system prompt and tools), a task, then
turns of one tool call and its result, kept both as Responses input items and as Anthropic messages. The model's own
answers are not used: the loop is deterministic."""

from __future__ import annotations

import json
import random
from typing import Any

from lpcache.workloads import chats

MAX_TOKENS = 12

HARNESS = chats.harness(7, n_chars=2000, n_tools=3)


def responses_tools() -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"]} for t in HARNESS.tools_json()]


def anthropic_tools() -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in HARNESS.tools_json()]


class AgentLoop:
    def __init__(self, seed: int, words: int = 150) -> None:
        self.words = words
        self.rng = random.Random(seed)
        task = "Task: " + chats.text(self.rng, 120)
        self.items: list[dict[str, Any]] = [{"role": "user", "content": task}]
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        self.turn = 0

    def advance(self) -> None:
        self.turn += 1
        tool = HARNESS.tools[self.turn % len(HARNESS.tools)]["function"]
        call_id = f"call_{self.turn}_{self.rng.randrange(10**8)}"
        arguments = {k: chats.sentence(self.rng)[:40] for k in tool["parameters"]["required"]}
        output = chats.text(self.rng, self.words)
        self.items += [{"type": "function_call", "call_id": call_id, "name": tool["name"],
                        "arguments": json.dumps(arguments, ensure_ascii=False)},
                       {"type": "function_call_output", "call_id": call_id, "output": output}]
        self.messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": tool["name"],
                                                            "input": arguments}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                        "content": output}]}]

    def responses_body(self) -> dict[str, Any]:
        return {"model": "llama.cpp", "instructions": HARNESS.system, "input": list(self.items),
                "tools": responses_tools(), "max_output_tokens": MAX_TOKENS, "temperature": 0}

    def messages_body(self) -> dict[str, Any]:
        return {"model": "llama.cpp", "system": HARNESS.system, "messages": list(self.messages),
                "tools": anthropic_tools(), "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0}}


