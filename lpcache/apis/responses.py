"""OpenAI Responses (POST /v1/responses, /responses): Codex-style agents. llama-server turns the body into a chat
request itself and passes `id_slot` on, so lpcache forwards it as it came, pinned, and its answer unchanged.

The prompt is `instructions`, then the `input` items in order (messages, `function_call`, `function_call_output`,
every field of each), with the fields that shape the rendered prompt (`tools`...). `previous_response_id` is not
supported by llama-server: such a request goes on uncached and llama-server answers it.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from .base import Api, View

# Request fields llama-server's conversion hands to the chat template besides the input.
# llama-server copies the whole body into the chat request, so the chat template fields count too.
TEMPLATE_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "reasoning", "text", "chat_template_kwargs",
                   "reasoning_effort", "reasoning_format", "add_generation_prompt", "continue_final_message",
                   "chat_template")


class ResponsesApi(Api):
    name = "responses"
    paths = ("/v1/responses", "/responses")

    def check(self, body: dict[str, Any]) -> None:
        if "input" not in body:
            raise BadRequest("'input' is required", code="invalid_input")
        if not isinstance(body["input"], str | list):
            raise BadRequest("'input' must be a string or an array of items", code="invalid_input")
        if "instructions" in body and not isinstance(body["instructions"], str | None):
            raise BadRequest("'instructions' must be a string", code="invalid_instructions")

    def view(self, body: dict[str, Any]) -> View:
        items: list[Any] = []
        if "instructions" in body:   # llama-server adds the system message whenever the key is there
            instructions = body["instructions"]
            items.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
        given = body["input"]
        items += [{"role": "user", "content": given}] if isinstance(given, str) else given
        template = {"api": self.name, **{k: body[k] for k in TEMPLATE_FIELDS if k in body}}
        return View(items, template, cacheable=not body.get("previous_response_id"))
