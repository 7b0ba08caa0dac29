"""A stand-in for llama.cpp's ``llama-server``, for lpcache's fast tests and smoke test.

It follows the reference contract where a proxy can observe it (slots, prefix reuse,
save/restore/erase, error shapes, SSE framing) with a toy tokenizer and a fake model
that answers deterministically. Test hooks under ``/mock/`` expose counters and
inject faults. Run it with ``python -m lpcache.mock_llama PORT MODEL [options]``.
``MockConfig(router=True, models=(...))`` (``--router --models a,b``) imitates router mode:
one child per model, loaded on demand (see ``router``).
"""

from lpcache.mock_llama.config import MockConfig
from lpcache.mock_llama.faults import Faults
from lpcache.mock_llama.runner import MockHandle, start_mock
from lpcache.mock_llama.server import create_app
from lpcache.mock_llama.state import MockState, Stats

__all__ = ["Faults", "MockConfig", "MockHandle", "MockState", "Stats", "create_app", "start_mock"]
