"""The live state of one stand-in server: slots, armed faults and counters."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lpcache.mock_llama.config import MockConfig
from lpcache.mock_llama.faults import Faults
from lpcache.mock_llama.slots import SlotPool
from lpcache.mock_llama.tokens import Vocab

if TYPE_CHECKING:
    from lpcache.mock_llama.router import Router


@dataclass
class Stats:
    """Counters read by tests through ``GET /mock/stats``."""

    chat_requests: int = 0  # inference tasks given a slot (chat and completion endpoints)
    chat_by_slot: Counter[int] = field(default_factory=Counter)
    prompt_tokens_computed: int = 0  # sum of prompt_n: tokens actually prefilled
    saves: int = 0
    restores: int = 0
    erases: int = 0
    save_failures: int = 0
    restore_failures: int = 0
    slot_actions_while_busy: int = 0  # slot actions that had to wait for their slot
    max_concurrent_per_slot: int = 0  # must stay 1: a slot never runs two tasks at once
    requests_by_path: Counter[str] = field(default_factory=Counter)  # /mock/* not counted
    unpinned_requests: int = 0  # inference tasks sent without `id_slot` (the server chose the slot)
    pinned_to_busy: int = 0  # pinned tasks that arrived while their slot computed another (must stay 0)
    queued: int = 0  # tasks waiting for a slot now
    max_queued: int = 0  # most tasks waiting for a slot at once (a proxy that lets the server queue them)

    def to_json(self) -> dict[str, Any]:
        return {
            "chat_requests": self.chat_requests,
            "chat_by_slot": {str(k): v for k, v in sorted(self.chat_by_slot.items())},
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "saves": self.saves,
            "restores": self.restores,
            "erases": self.erases,
            "save_failures": self.save_failures,
            "restore_failures": self.restore_failures,
            "slot_actions_while_busy": self.slot_actions_while_busy,
            "max_concurrent_per_slot": self.max_concurrent_per_slot,
            "requests_by_path": dict(self.requests_by_path),
            "unpinned_requests": self.unpinned_requests,
            "pinned_to_busy": self.pinned_to_busy,
            "max_queued": self.max_queued,
        }


class MockState:
    """Everything a running stand-in knows; ``start_mock`` hands it to tests as ``app_state``."""

    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.pool = SlotPool(config.slots, config.n_ctx)
        self.faults = Faults()
        self.faults.update(config.faults)
        self.stats = Stats()
        self.vocab = Vocab()
        self.closing = asyncio.Event()  # set when the server stops; ends hung requests
        self.loop: asyncio.AbstractEventLoop | None = None
        self.router: Router | None = None  # set in router mode: the children, one per model
        self._task_ids = 0

    def child(self, model: str) -> MockState:
        """The state of one model of a router: its own slots and counters; faults, vocabulary and shutdown shared."""
        child = MockState(replace(self.config, model=model, router=False, models=()))
        child.faults, child.vocab, child.closing = self.faults, self.vocab, self.closing
        return child

    def reset_slots(self) -> None:
        """Empty slots, as a freshly started server has (a router's child being unloaded)."""
        self.pool = SlotPool(self.config.slots, self.config.n_ctx)

    def next_task_id(self) -> int:
        self._task_ids += 1
        return self._task_ids
