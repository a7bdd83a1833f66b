"""What a request through the gateway must not cost: work that can be done once per
backend class or per request done per request or per token instead (issue 53).
Each test counts the work itself, never time."""

from __future__ import annotations

import asyncio
import typing

import pytest

from gateway.backends import OutputCountingBackend, PrefixCachingBackend
from gateway.backends.capabilities import supports
from gateway.backends.fake import FakeBackend
from gateway.backends.remote import RemoteBackend
from gateway.backends.spec import BackendSpec
from gateway.tenancy.auth import EPOCH_CHECK_S

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TEXT = {"model": "fake-model", "prompt": "hi", "max_tokens": 8}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
def protocol_checks(monkeypatch) -> list[type]:
    """Every `isinstance` against a runtime-checkable Protocol, by the protocol asked."""
    asked: list[type] = []
    check = typing._ProtocolMeta.__instancecheck__

    def counted(cls, instance):
        asked.append(cls)
        return check(cls, instance)

    monkeypatch.setattr(typing._ProtocolMeta, "__instancecheck__", counted)
    return asked


async def test_requests_ask_no_protocol_isinstance(gw, protocol_checks):
    """A backend's capabilities are decided once per class: after the first request,
    chat and text completions, whole and streamed, ask none (each asked 30-50 us)."""
    _, key = await gw.tenant()
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        for extra in ({}, STREAM):
            r = await gw.post(path, key, body | extra)
            assert r.status == 200, await r.text()
            await r.read()
    protocol_checks.clear()
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        for extra in ({}, STREAM):
            r = await gw.post(path, key, body | extra)
            assert r.status == 200, await r.text()
            await r.read()
    assert protocol_checks == []


def test_supports_answers_as_isinstance():
    fake = FakeBackend(BackendSpec("fake", "fake", "", "fake-model"))
    remote = RemoteBackend(BackendSpec("up", "remote", "", "m", {"url": "http://127.0.0.1:9"}))
    for backend in (fake, remote, fake, remote):  # the second time from what was decided
        for protocol in (PrefixCachingBackend, OutputCountingBackend):
            assert supports(backend, protocol) == isinstance(backend, protocol)
    assert supports(remote, OutputCountingBackend) and not supports(fake, OutputCountingBackend)


async def test_the_auth_epoch_is_read_on_sqlite_without_a_thread_hop(gw, monkeypatch):
    """Under load the auth epoch is read ten times a second: on SQLite through the plain
    sqlite3 connection, never aiosqlite's worker thread (each read cost the event loop
    milliseconds of GIL hand-offs); test_revocation holds what the reads are for."""
    _, key = await gw.tenant()
    r = await gw.post("/v1/chat/completions", key, CHAT)  # the key's own load is a hop
    assert r.status == 200, await r.text()
    db = gw.state.db
    hops: list[str] = []
    autocommit = db.autocommit

    def counted():
        hops.append("autocommit")
        return autocommit()

    monkeypatch.setattr(db, "autocommit", counted)
    for _ in range(3):
        r = await gw.post("/v1/chat/completions", key, CHAT)
        assert r.status == 200, await r.text()
        await asyncio.sleep(EPOCH_CHECK_S * 1.5)  # the next request reads the epoch
    assert hops == []


async def test_the_rates_hear_of_a_stream_at_its_first_token_and_end(gw, monkeypatch):
    """The dashboard's rates hear of a 64-token answer at its first token and when it
    ends, not once a chunk; they still hear of every token it billed."""
    _, key = await gw.tenant()
    told: list[tuple[int, int]] = []
    traffic = gw.state.traffic
    streamed = traffic.tokens_streamed

    def counted(tenant_id, name, prompt, output, now=None):
        told.append((prompt, output))
        streamed(tenant_id, name, prompt, output, now)

    monkeypatch.setattr(traffic, "tokens_streamed", counted)
    for extra in ({}, STREAM):
        told.clear()
        r = await gw.post("/v1/chat/completions", key, CHAT | {"max_tokens": 64} | extra)
        assert r.status == 200, await r.text()
        await r.read()
        assert len(told) <= 2 and sum(output for _, output in told) == 64


async def test_a_row_is_queued_without_a_task_of_its_own(gw):
    """A request whose tokens need no tokenizer count queues its usage row at once and
    awaits only the commit: no task a request (a turn of the loop and ~10 us each)."""
    _, key = await gw.tenant()
    loop = asyncio.get_running_loop()
    made: list[str] = []
    factory = loop.get_task_factory()

    def counted(loop, coro, **kw):
        made.append(getattr(coro, "__qualname__", ""))
        return factory(loop, coro, **kw) if factory else asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(counted)
    try:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
            for extra in ({}, STREAM):
                r = await gw.post(path, key, body | extra)
                assert r.status == 200, await r.text()
                await r.read()
    finally:
        loop.set_task_factory(factory)
    assert not [name for name in made if name.startswith(("Job.", "JobFinish."))]
