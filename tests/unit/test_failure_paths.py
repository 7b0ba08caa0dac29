"""The failure paths' small rules: one half-open probe, the prober that never dies and closes a breaker as soon as a
down backend answers, which saves are retried, the lease that always gives its slot back, the whole slot wait
bounded by SLOT_WAIT_TIMEOUT, and a pooled connection found closed sent again at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from lpcache.backends.backend import CLOSED, Backend, Breaker, Prober
from lpcache.backends.llama import LlamaClient, SlotAction, client_session
from lpcache.backends.placement import WaitPlan, Want
from lpcache.backends.slot_pool import Lease, SlotPool
from lpcache.backends.slots import Slot
from lpcache.config import BackendConfig
from lpcache.errors import BackendUnreachable, SlotsBusy
from lpcache.flow.saving import retryable

# ---- the breaker: exactly one probe per cooldown ----


def test_half_open_lets_exactly_one_claim_through() -> None:
    b = Breaker(base_cooldown=1.0)
    b.failure(0.0)
    assert not b.claim(0.5)                      # cooling down: nothing is the probe
    assert b.available(1.0)
    assert b.claim(1.0)                          # the first try after the cooldown is the probe
    assert not b.available(1.0)
    assert [b.claim(1.0) for _ in range(5)] == [False] * 5   # no second probe in the same cooldown
    b.failure(1.2)                               # the probe failed: a new, longer cooldown, with its own probe
    assert not b.claim(2.0) and b.claim(3.2)


def test_a_closed_breaker_lets_every_claim_through() -> None:
    b = Breaker()
    assert all(b.claim(float(i)) for i in range(3)) and b.state == CLOSED


class _Client:
    """A backend client whose /props answers as told (a callable: raise or return)."""

    url = "http://x"

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked = 0

    async def props(self, model: str | None = None) -> dict[str, Any]:
        self.asked += 1
        return self.answer()  # type: ignore[no-any-return]

    async def get_json(self, path: str) -> Any:
        return {"data": []}


def _backend(answer: Any, cooldown: float = 60.0) -> tuple[Backend, _Client]:
    client = _Client(answer)
    backend = Backend(0, BackendConfig("http://x", 1), client, 1, Breaker(cooldown, cooldown))  # type: ignore[arg-type]
    return backend, client


def _raise(e: BaseException) -> Any:
    def answer() -> Any:
        raise e
    return answer


def test_the_prober_closes_a_down_backend_as_soon_as_it_answers() -> None:
    async def run() -> None:
        state = {"up": False}
        backend, client = _backend(lambda: {"total_slots": 1} if state["up"] else _raise(
            BackendUnreachable("refused"))())
        backend.failed("refused")                     # down, for 60 s
        prober = Prober([backend], lambda b, n: None)
        await prober.round()
        assert client.asked == 1 and backend.breaker.state == "open" and backend.breaker.failures == 1
        state["up"] = True
        await prober.round()                          # long before the cooldown's end
        assert backend.breaker.state == CLOSED

    asyncio.run(run())


def test_a_backend_that_answered_errors_waits_out_its_cooldown() -> None:
    async def run() -> None:
        backend, client = _backend(lambda: {"total_slots": 1})
        backend.failed("HTTP 500", down=False)
        await Prober([backend], lambda b, n: None).round()
        assert client.asked == 0 and backend.breaker.state == "open"

    asyncio.run(run())


def test_the_prober_does_not_probe_a_half_open_backend_whose_probe_is_out() -> None:
    async def run() -> None:
        backend, client = _backend(lambda: {"total_slots": 1}, cooldown=0.001)
        backend.failed("refused")
        assert backend.breaker.claim(backend.breaker.open_until)   # at the cooldown's end, a request took the probe
        await Prober([backend], lambda b, n: None).round()
        assert client.asked == 0

    asyncio.run(run())


def test_the_prober_survives_any_exception() -> None:
    async def run() -> None:
        backend, client = _backend(_raise(RuntimeError("a bug")), cooldown=0.001)
        backend.failed("refused")
        prober = Prober([backend], lambda b, n: None, interval=0.01)
        prober.start()
        try:
            deadline = time.monotonic() + 5
            while client.asked < 3:   # it keeps probing after the crash
                assert time.monotonic() < deadline and prober._task is not None and not prober._task.done()
                await asyncio.sleep(0.01)
        finally:
            await prober.stop()

    asyncio.run(run())


# ---- which saves are retried ----


@pytest.mark.parametrize(("status", "again"), [
    (0, True), (500, True), (502, True), (503, True), (504, True),
    (501, False), (400, False), (401, False), (403, False), (404, False), (200, False),
])
def test_only_a_save_that_can_succeed_later_is_retried(status: int, again: bool) -> None:
    assert retryable(SlotAction(status == 200, status, {}, 1.0)) is again


# ---- the lease ----


def test_a_lease_gives_its_slot_back_whatever_is_raised() -> None:
    async def run() -> None:
        pool = SlotPool([Slot(0, 0, True, None, "http://x")], wait_timeout=1.0)
        for error in (RuntimeError("bug"), asyncio.CancelledError()):
            choice = await pool.acquire(Want())
            lease = Lease(pool, choice)
            with pytest.raises(type(error)):
                async with lease:
                    raise error
            assert not choice.slot.busy
            choice.slot.busy = True      # given back once only: a second give-back frees nobody else's slot
            lease.give_back()
            assert choice.slot.busy
            choice.slot.busy = False
        choice = await pool.acquire(Want())
        async with Lease(pool, choice) as kept:   # no error: the holder keeps it
            pass
        assert choice.slot.busy
        kept.give_back()
        assert not choice.slot.busy

    asyncio.run(run())


def test_slot_wait_timeout_bounds_the_whole_wait() -> None:
    async def run() -> None:
        pool = SlotPool([Slot(0, 0, True, None, "http://x")], wait_timeout=0.4)
        await pool.acquire(Want())                       # the only slot is busy from here on
        started = time.monotonic()
        with pytest.raises(SlotsBusy):
            await pool.take(Want(), WaitPlan(lambda s: True, 0.3))
        assert time.monotonic() - started < 0.6           # not 0.3 + 0.4

    asyncio.run(run())


# ---- a pooled connection the server closed ----


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A request's head and its body (by its Content-Length), as a raw HTTP server reads them."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


async def _server(answer_once: bool) -> tuple[asyncio.Server, list[int]]:
    """A raw HTTP server: each connection answers its first request (keep-alive) and closes on the next one without
    answering, as llama-server does when its keep-alive ran out just as the request came. `answer_once` False:
    it closes every connection at once (a server that is really failing)."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        _WRITERS.add(writer)
        served = 0
        try:
            while True:
                await read_request(reader)
                if served or not answer_once:
                    break
                body = b'{"id_slot": 0, "filename": "f", "n_saved": 3, "n_written": 30}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, connections


def test_a_request_on_a_pooled_connection_found_closed_is_sent_again_at_once() -> None:
    async def run() -> None:
        server, connections = await _server(answer_once=True)
        port = server.sockets[0].getsockname()[1]
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)
            for _ in range(3):
                started = time.monotonic()
                result = await client.slot_action(0, "save", "f")
                assert result.ok and time.monotonic() - started < 1.0
        server.close()
        assert len(connections) == 3    # each later request: the pooled one found closed, then a new one

    asyncio.run(run())


def test_a_fresh_connection_that_fails_is_not_sent_again() -> None:
    async def run() -> None:
        server, connections = await _server(answer_once=False)
        port = server.sockets[0].getsockname()[1]
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)
            result = await client.slot_action(0, "save", "f")
        server.close()
        assert not result.ok and result.status == 0 and len(connections) == 1

    asyncio.run(run())


def test_a_slot_action_count_is_an_int_the_server_reported_or_none() -> None:
    """`n_saved` and the like as the server wrote them: a bool, a float, a string or nothing is not a count."""
    action = SlotAction(True, 200, {"n_saved": 812, "n_written": True, "n_read": 3.0, "n_restored": "812"}, 1.0)
    assert action.count("n_saved") == 812
    assert [action.count(n) for n in ("n_written", "n_read", "n_restored", "missing")] == [None] * 4


_WRITERS: set[asyncio.StreamWriter] = set()   # the open connections of every `_llama_like` (to break them)


async def _llama_like(close_after_stream: bool = True, drop_second: bool = False, drop_first: bool = False,
                      port: int = 0, work: float = 0.0) -> tuple[asyncio.Server, list[int], list[bytes]]:
    """A raw HTTP server answering chat requests as llama-server b11434 does: keep-alive, but a streamed answer's
    connection is closed after its last event (saying so only when the request asked for it: cpp-httplib echoes a
    request's `Connection: close`). `drop_second` (`drop_first`): a connection's second (first) request is read and
    the connection closed without an answer, after `work` seconds spent on it. Returns the server, one entry per
    connection, and each request line read."""
    connections: list[int] = []
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        _WRITERS.add(writer)
        served = 0
        try:
            while True:
                head, body = await read_request(reader)
                requests.append(head.split(b"\r\n", 1)[0])
                if (drop_second and served) or drop_first:
                    await asyncio.sleep(work)   # the server works on it, then the connection breaks
                    break
                served += 1
                if b'"stream":true' in body:
                    events = (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
                              b"data: [DONE]\n\n")
                    close = b"Connection: close\r\n" if b"connection: close" in head.lower() else b""   # echoed
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: timeout=5, "
                                 b"max=100\r\n" + close + b"Content-Length: " + str(len(events)).encode()
                                 + b"\r\n\r\n" + events)
                    await writer.drain()
                    if close_after_stream:
                        break
                    continue
                answer = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}]}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5, max=100"
                             b"\r\nContent-Length: " + str(len(answer)).encode() + b"\r\n\r\n" + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            _WRITERS.discard(writer)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, connections, requests


def test_a_streamed_answers_connection_is_not_reused() -> None:
    """llama-server closes it after the last event: the next request goes out on a new connection, at once, and
    once (with the connection pooled it would meet a dead one, and a generation is never sent again)."""
    async def run() -> None:
        server, connections, requests = await _llama_like()
        port = server.sockets[0].getsockname()[1]
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)
            for stream in (True, False, True, True, False, False):
                upstream = await client.chat({"messages": [{"role": "user", "content": "hi"}], "stream": stream}, 0)
                await upstream.read()
                upstream.release()
        server.close()
        assert len(requests) == 6, requests   # none sent twice, none failed
        assert len(connections) == 4          # a new one after each stream; the plain answers' one reused

    asyncio.run(run())


def test_a_generation_whose_pooled_connection_broke_goes_again_to_the_same_slot() -> None:
    """Before any answer: the server closed it (or cancels what it read); a new connection, the same pinned slot."""
    async def run() -> None:
        server, connections, requests = await _llama_like(drop_second=True)
        port = server.sockets[0].getsockname()[1]
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)
            for _ in range(2):
                upstream = await client.chat(dict(body), 1)
                assert b"Hi" in await upstream.read()
                upstream.release()
        server.close()
        assert len(requests) == 3 and len(connections) == 2, (requests, connections)
        assert all(b"id_slot=1" in r for r in requests), requests

    asyncio.run(run())


def test_a_generation_on_a_new_connection_that_breaks_is_not_sent_again() -> None:
    """The server broke a connection opened for the request: its failure, the caller fails over."""
    async def run() -> None:
        server, connections, requests = await _llama_like(drop_first=True)
        port = server.sockets[0].getsockname()[1]
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)
            with pytest.raises(BackendUnreachable):
                await client.chat({"messages": [{"role": "user", "content": "hi"}]}, 0)
        server.close()
        assert len(requests) == 1 and len(connections) == 1, (requests, connections)

    asyncio.run(run())


async def _answered(client: LlamaClient) -> None:
    """One plain chat request, its answer read and its connection given back to the pool."""
    upstream = await client.chat({"messages": [{"role": "user", "content": "hi"}]}, 0)
    await upstream.read()
    upstream.release()


def test_a_generation_after_a_server_restart_passes_every_dead_pooled_connection() -> None:
    """A restarted server leaves lpcache's pooled connections to it all dead: the first request after it is
    answered, not failed over (a one-slot server would answer 502)."""
    async def run() -> None:
        server, _, _ = await _llama_like()
        port = server.sockets[0].getsockname()[1]
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)

            await asyncio.gather(*(_answered(client) for _ in range(4)))   # four connections pooled
            server.close()
            for writer in list(_WRITERS):   # and every connection it had open
                writer.close()
            again, connections, requests = await _llama_like(port=port)
            await _answered(client)
            again.close()
        assert len(requests) == 1 and len(connections) == 1, (requests, connections)

    asyncio.run(run())


def test_a_generation_that_broke_after_the_server_worked_on_it_is_not_sent_again() -> None:
    """A break long after sending (the server died mid-generation, a balancer cut an idle-looking answer) is the
    server's failure: the generation is not run once more per pooled connection."""
    async def run() -> None:
        server, connections, requests = await _llama_like(drop_second=True, work=1.0)
        port = server.sockets[0].getsockname()[1]
        async with client_session() as session:
            client = LlamaClient(f"http://127.0.0.1:{port}", session, timeout=5.0)

            await asyncio.gather(*(_answered(client) for _ in range(4)))   # four pooled, each with an answer
            with pytest.raises(BackendUnreachable):
                await client.chat({"messages": [{"role": "user", "content": "hi"}]}, 0)
        server.close()
        assert len(connections) == 4 and len(requests) == 5, (connections, requests)

    asyncio.run(run())
