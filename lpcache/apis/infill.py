"""Fill-in-the-middle (POST /infill): editors (llama.vim, llama.vscode). `id_slot` passes through.

llama-server lays the prompt out as: the extra context chunks (`input_extra`, the editor's ring of recently seen
code), then the FIM prefix token, `input_prefix` and `prompt`, then the FIM suffix token and `input_suffix`. The
identity follows that order, so requests that share the extra context and the code above the cursor share a cache.

llama-server keeps only the last 3/4 of a batch (1,536 tokens at the default `-b 2048`) of a long `input_prefix`:
the tokens after the extra context then no longer start with the prefix's start. A prefix longer than
PREFIX_EXACT_CHARS (a token has at least one character) is therefore left out of the identity: only the extra
context is claimed, which stays exact.
"""

from __future__ import annotations

from typing import Any

from lpcache.apis.base import Api, View
from lpcache.errors import BadRequest

PREFIX_EXACT_CHARS = 1536


class InfillApi(Api):
    name = "infill"
    paths = ("/infill",)

    def check(self, body: dict[str, Any]) -> None:
        for name in ("input_prefix", "input_suffix", "prompt"):
            if name in body and not isinstance(body[name], str):
                raise BadRequest(f"'{name}' must be a string", code=f"invalid_{name}")
        extra = body.get("input_extra", [])
        if not isinstance(extra, list) or not all(
                isinstance(c, dict) and isinstance(c.get("text", ""), str) and isinstance(c.get("filename", ""), str)
                for c in extra):
            raise BadRequest("'input_extra' must be an array of {filename, text} objects", code="invalid_input_extra")

    def view(self, body: dict[str, Any]) -> View:
        extra = [{"filename": c.get("filename", "tmp"), "text": c.get("text", "")} for c in body.get("input_extra", [])]
        items: list[Any] = [{"role": "input_extra", "content": extra_text(extra)}]
        prefix = body.get("input_prefix", "")
        rest = [{"role": "input_prefix", "content": prefix}, {"role": "prompt", "content": body.get("prompt", "")},
                {"role": "input_suffix", "content": body.get("input_suffix", "")}]
        shown = [*items, *rest]
        texts = [c["text"] for c in extra] + [m["content"] for m in rest]
        if len(prefix) <= PREFIX_EXACT_CHARS:
            return View(shown, {"api": self.name}, "\n".join(texts))
        return View(items, {"api": self.name}, "\n".join(texts), shown=shown)


def extra_text(extra: list[dict[str, str]]) -> str:
    """The extra chunks as one text, each under its file name (their order is the prompt's)."""
    return "".join(f"\x1c{c['filename']}\x1f{c['text']}" for c in extra)
