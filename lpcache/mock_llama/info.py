"""What a single-model server says about itself: ``/health``, ``/models``, ``/props``.

In router mode ``/props?model=X`` is this same answer from the child serving X.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lpcache.mock_llama.api import state_of
from lpcache.mock_llama.config import MockConfig
from lpcache.mock_llama.errors import json_response


def model_meta(config: MockConfig) -> dict[str, Any]:
    """The ``meta`` of a loaded model in ``/v1/models``."""
    return {"n_ctx": config.n_ctx, "n_ctx_train": config.n_ctx, "vocab_type": 0}


async def health(request: Request) -> Response:
    return json_response({"status": "ok"})


async def models(request: Request) -> Response:
    config = state_of(request).config
    model = {
        "id": config.model,
        "object": "model",
        "owned_by": "llamacpp",
        "created": int(time.time()),
        "meta": model_meta(config),
    }
    return json_response({"object": "list", "data": [model], "models": [{"name": config.model, "model": config.model}]})


async def props(request: Request) -> Response:
    config = state_of(request).config
    return json_response(
        {
            "default_generation_settings": {"n_ctx": config.n_ctx, "params": {"n_predict": config.max_tokens_default}},
            "total_slots": config.slots,
            "model_alias": config.model,
            "model_path": config.model,
            "chat_template": "chatml",
            "bos_token": "",
            "eos_token": "<|im_end|>",
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": False,
            "is_sleeping": False,
            "build_info": "mock",
            "role": "model",
        }
    )
