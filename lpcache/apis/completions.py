"""Text completions (POST /v1/completions, /completions, /completion): scripts and llama.cpp's own clients. The
prompt is the text, or the token ids, as llama-server reads them; `id_slot` passes through.

Several prompts in one request (an array of texts or of token arrays, a multimodal prompt object) or several answers
(`n` > 1: llama-server gives the extra tasks no pin) are served uncached.
"""

from __future__ import annotations

from typing import Any

from lpcache.apis.base import Api, View
from lpcache.errors import BadRequest


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class CompletionsApi(Api):
    name = "completions"
    paths = ("/v1/completions", "/completions", "/completion")

    def check(self, body: dict[str, Any]) -> None:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", code="invalid_prompt")

    def view(self, body: dict[str, Any]) -> View:
        prompt = body["prompt"]
        one = not any(isinstance(body.get(many), int) and body[many] > 1 for many in ("n", "n_cmpl"))
        template = {"api": self.name}
        if isinstance(prompt, str):
            return View([{"role": "prompt", "content": prompt}], template, cacheable=one)
        if _token_ids(prompt):
            return View([{"role": "prompt", "content": prompt}], template, " ".join(map(str, prompt)), one)
        prompts = prompt if isinstance(prompt, list) else [prompt]   # several prompts, or a multimodal object
        shown = [{"role": "prompt", "content": p if isinstance(p, str) else
                  p.get("prompt_string") if isinstance(p, dict) else None} for p in prompts]
        return View(shown, template, cacheable=False)
