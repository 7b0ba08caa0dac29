"""The stand-in's settings, checked once when they are made."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MockConfig:
    """Settings of a stand-in llama-server; every field is also a CLI flag.

    ``port`` 0 lets ``start_mock`` pick a free port. ``slot_save_path`` None disables
    every ``POST /slots/*`` with 501, as on the real server. ``faults`` is armed at start
    (same keys as ``POST /mock/faults``).

    ``router`` imitates llama-server's router mode (started without ``-m``): one child per
    name in ``models``, each with its own ``slots`` slots and KV, all sharing
    ``slot_save_path``; ``model`` is then unused. At most ``models_max`` children are
    loaded at once (0: no limit); ``models_autoload`` is the default of ``?autoload=``.
    """

    port: int = 0
    model: str = "mock-model"
    host: str = "127.0.0.1"
    slots: int = 2
    slot_save_path: str | None = None
    n_ctx: int = 8192
    prefill_ms_per_token: float = 0.0
    gen_ms_per_token: float = 0.0
    # A slot file's size per token, as a real model's KV cache weighs (SmolLM2-135M: about 23 KB; a 7B model's
    # f16 cache: about 0.5 MB): the files are padded to it, so a save and a restore cost real disk time. 0: tiny files.
    kv_bytes_per_token: int = 0
    max_tokens_default: int = 16
    api_key: str | None = None  # comma-separated list accepted, like --api-key
    # Imitate a sliding-window model without --swa-full: a restored slot is never reused (the server re-computes
    # the whole prompt), as llama-server b11434 does when no context checkpoint survives the restore.
    swa: bool = False
    # The model has fill-in-the-middle tokens (POST /infill works); False answers /infill with the 501 of a model
    # without them, as llama-server b11434 does with SmolLM2.
    fim: bool = True
    faults: dict[str, Any] = field(default_factory=dict)
    router: bool = False
    models: tuple[str, ...] = ()
    models_max: int = 4  # llama-server's --models-max default
    models_autoload: bool = True

    def __post_init__(self) -> None:
        self.models = tuple(self.models)
        if self.models and not self.router:
            raise ValueError("models are only for router mode (router=True, --router)")
        if any(not name for name in self.models) or len(set(self.models)) != len(self.models):
            raise ValueError(f"model names must be non-empty and distinct, got {self.models}")
        if self.models_max < 0:
            raise ValueError(f"models_max must not be negative (0: unlimited), got {self.models_max}")
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}")
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx must be at least 1, got {self.n_ctx}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must not be negative, got {self.kv_bytes_per_token}")
        if self.prefill_ms_per_token < 0 or self.gen_ms_per_token < 0:
            raise ValueError("per-token latencies must not be negative")
        if self.max_tokens_default < 0:
            raise ValueError(f"max_tokens_default must not be negative, got {self.max_tokens_default}")
        if self.slot_save_path is not None and not os.path.isdir(self.slot_save_path):
            raise ValueError(f"slot_save_path is not an existing directory: {self.slot_save_path}")

    @property
    def api_keys(self) -> frozenset[str]:
        if not self.api_key:
            return frozenset()
        return frozenset(k.strip() for k in self.api_key.split(",") if k.strip())
