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
TEMPLATE_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "reasoning", "text", "chat_template_kwargs")


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

    def view(self, body: dict[str, Any]) -> View | None:
        if body.get("previous_response_id"):
            return None
        items: list[Any] = []
        if isinstance(body.get("instructions"), str):
            items.append({"role": "system", "content": body["instructions"]})
        given = body["input"]
        items += [{"role": "user", "content": given}] if isinstance(given, str) else given
        template = {"api": self.name, **{k: body[k] for k in TEMPLATE_FIELDS if k in body}}
        return View(items, template)
