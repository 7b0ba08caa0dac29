"""Coding-agent sessions as the OpenAI Responses and Anthropic Messages APIs carry them, deterministic from a seed.

Why: an agent (Codex, Claude Code, opencode...) resends its whole history on every turn: one harness (a long system
prompt and the schemas of its tools) that all its sessions share, the user's task, then its tool loop: the model's
tool calls and the tools' results. Each request is the previous one plus a tool call and its result, so a cache that
keeps a session's prefix leaves only the new tokens to compute. Here the tool loop is scripted: the model's real
answers are never used, so the workload is the same on every run and every machine (benchmarks, tests).

- `harness(seed)`: the system prompt (with an environment block) and eight tools (read_file, write_file,
  apply_patch, run_shell, search_code, list_dir, glob_files, todo_write) with JSON-schema parameters.
- `sessions(n, steps=8, seed=1)`: n sessions on one harness, sent alternately as Responses and Messages; each one
  a task and `steps` tool exchanges (a call, sometimes two at once, and their results: numbered source files,
  shell output, search hits, directory trees).
- `Session.body(turn)`: request `turn` (0 .. steps; it carries `turn` exchanges) in the session's API shape;
  `Session.responses`, `Session.messages` give either shape; `Session.chat` the chat-completions body llama-server
  (b11434, tools/server/server-chat.cpp) turns either into, for `/apply-template` to count its prompt tokens.

Stdlib only; `random.Random` seeded with strings, so the same seed gives the same bodies everywhere.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from lpcache.workloads import agent_texts as texts

__all__ = ["API_PATHS", "APIS", "Call", "Harness", "Session", "Tool", "harness", "sessions"]

Body = dict[str, Any]
APIS = ("responses", "messages")
API_PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}

_ID = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0123456789"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]   # a JSON schema of type object


@dataclass(frozen=True)
class Harness:
    """What every session of one agent program starts with."""

    system: str
    tools: tuple[Tool, ...]

    def responses_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
                for t in self.tools]

    def messages_tools(self) -> list[dict[str, Any]]:
        return [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in self.tools]

    def chat_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]


@dataclass(frozen=True)
class Call:
    """One scripted tool call and what the tool returned."""

    key: str                     # the shapes' ids: call_<key> (Responses), toolu_<key> (Messages)
    name: str
    arguments: dict[str, Any]
    output: str

    def call_id(self, api: str) -> str:
        return ("call_" if api == "responses" else "toolu_") + self.key

    @property
    def arguments_json(self) -> str:
        """Compact, as llama-server writes a Messages `input` into chat arguments (nlohmann `dump()`)."""
        return json.dumps(self.arguments, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Session:
    """One agent session: its task, then `len(steps)` tool exchanges; request `turn` carries the first `turn`."""

    index: int
    api: str
    harness: Harness
    task: str
    steps: tuple[tuple[Call, ...], ...]
    model: str = "smollm2"

    @property
    def turns(self) -> int:
        return len(self.steps) + 1

    def body(self, turn: int, *, max_tokens: int = 16, stream: bool = False) -> Body:
        """Request `turn` in this session's own API shape."""
        shape = self.responses if self.api == "responses" else self.messages
        return shape(turn, max_tokens=max_tokens, stream=stream)

    def _done(self, turn: int) -> tuple[tuple[Call, ...], ...]:
        if not 0 <= turn < self.turns:
            raise IndexError(f"turn {turn} of a session of {self.turns} turns")
        return self.steps[:turn]

    def responses(self, turn: int, *, max_tokens: int = 16, stream: bool = False) -> Body:
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": self.task}]
        for calls in self._done(turn):
            items += [{"type": "function_call", "call_id": c.call_id("responses"), "name": c.name,
                       "arguments": c.arguments_json} for c in calls]
            items += [{"type": "function_call_output", "call_id": c.call_id("responses"), "output": c.output}
                      for c in calls]
        return {"model": self.model, "instructions": self.harness.system, "input": items,
                "tools": self.harness.responses_tools(), "max_output_tokens": max_tokens, "temperature": 0,
                "stream": stream}

    def messages(self, turn: int, *, max_tokens: int = 16, stream: bool = False) -> Body:
        messages: list[dict[str, Any]] = [{"role": "user", "content": self.task}]
        for calls in self._done(turn):
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c.call_id("messages"), "name": c.name, "input": c.arguments}
                for c in calls]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c.call_id("messages"), "content": c.output} for c in calls]})
        return {"model": self.model, "system": self.harness.system, "messages": messages,
                "tools": self.harness.messages_tools(), "max_tokens": max_tokens, "temperature": 0, "stream": stream}

    def chat(self, turn: int, api: str | None = None) -> Body:
        """The chat-completions body llama-server makes of request `turn` (in `api`'s shape, else the session's):
        a system message, the task, then per exchange an assistant message with the tool calls and a tool message
        per result."""
        api = api or self.api
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.harness.system},
                                          {"role": "user", "content": self.task}]
        for calls in self._done(turn):
            messages.append({"role": "assistant", "content": "" if api == "messages" else None, "tool_calls": [
                {"id": c.call_id(api), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]})
            messages += [{"role": "tool", "tool_call_id": c.call_id(api), "content": c.output} for c in calls]
        return {"model": self.model, "messages": messages, "tools": self.harness.chat_tools()}


def sessions(n: int, steps: int = 8, seed: int = 1, *, harness_seed: int | None = None, model: str = "smollm2",
             apis: tuple[str, ...] = APIS) -> list[Session]:
    """n sessions sharing one harness, the i-th sent as apis[i % len(apis)], each a task and `steps` exchanges."""
    h = harness(seed if harness_seed is None else harness_seed)
    out = []
    for i in range(n):
        rng = random.Random(f"agent-session:{seed}:{i}")
        project = texts.project(rng)
        plan = _plan(rng, steps)
        task = texts.task(rng, project)
        calls = tuple(tuple(_call(rng, name, project) for name in names) for names in plan)
        out.append(Session(i, apis[i % len(apis)], h, task, calls, model))
    return out


def harness(seed: int = 1) -> Harness:
    """The system prompt (with an environment block) and the eight tools."""
    rng = random.Random(f"agent-harness:{seed}")
    tools = tuple(Tool(name, description, {"type": "object", "properties": properties, "required": list(required),
                                           "additionalProperties": False})
                  for name, description, properties, required in texts.TOOL_SPECS)
    return Harness(texts.SYSTEM + texts.environment(rng), tools)


def _plan(rng: random.Random, steps: int) -> list[list[str]]:
    """Which tools each exchange calls: explore first, then read, edit and test; two reads at once now and then."""
    plan: list[list[str]] = [[rng.choice(("list_dir", "glob_files", "search_code"))]]
    if steps > 3 and rng.random() < 0.5:
        plan.append(["todo_write"])
    while len(plan) < steps:
        left = steps - len(plan)
        if left == 1:
            plan.append(["run_shell"])
            continue
        name = rng.choices(("read_file", "search_code", "run_shell", "apply_patch", "write_file", "list_dir"),
                           (5, 2, 3, 2, 1, 1))[0]
        plan.append([name, "read_file"] if name == "read_file" and rng.random() < 0.12 else [name])
    return plan[:steps]


def _call(rng: random.Random, name: str, p: texts.Project) -> Call:
    key = "".join(rng.choice(_ID) for _ in range(24))
    arguments, output = texts.RUNS[name](rng, p)
    return Call(key, name, arguments, output)
