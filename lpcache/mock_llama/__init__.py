"""A stand-in for llama.cpp's ``llama-server``, for lpcache's fast tests and smoke test.

It follows the reference contract where a proxy can observe it (slots, prefix reuse,
save/restore/erase, error shapes, SSE framing) with a toy tokenizer and a fake model
that answers deterministically. Test hooks under ``/mock/`` expose counters and
inject faults. Run it with ``python -m lpcache.mock_llama PORT MODEL [options]``.
``MockConfig(router=True, models=(...))`` (``--router --models a,b``) imitates router mode:
one child per model, loaded on demand (see ``router``).
"""

from .config import MockConfig
from .faults import Faults
from .runner import MockHandle, start_mock
from .server import create_app
from .state import MockState, Stats

__all__ = ["Faults", "MockConfig", "MockHandle", "MockState", "Stats", "create_app", "start_mock"]
