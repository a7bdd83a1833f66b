"""`type = "remote"` backends when the upstream fails: a real `kvgate serve` in front of
test-local upstreams that fail on demand (500s, invalid JSON, accepting and never
answering, stopping mid-stream), and real `kvgate worker`s killed with SIGKILL.

Whatever the upstream does, the client gets a 503 or an error event with an OpenAI-shaped
body, never a hang; the tenant's reservations settle (a tenant allowed one request at a
time is not refused for concurrency afterwards); another replica keeps serving, and a
failing one leaves the rotation and comes back when it answers again.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from engine_api.block_hash import hash_blocks
from engine_api.records import BackendStats
from studies.harness import ThreadedApps
from tests.conftest import LiveGateway, start_gateway
from tests.gateway.test_remote import (
    MODEL,
    backend_health,
    gateway_over_workers,
    name_of,
    remote_config,
    start_worker,
    wait_until,
    worker_stats,
)

CHUNKS_BEFORE_FAULT = 2  # "cut" and "stall" stop after this many chunks
FAULTS_BEFORE_OUTPUT = ["500", "garbage", "hang"]


class FakeUpstream(ThreadedApps):
    """An upstream on a loopback port, served from a thread: a kvgate worker's routes
    (kind "worker") or a third-party server's (kind "openai": SSE without usage, no
    /health), failing as `mode` says: "ok", "500", "garbage" (invalid JSON everywhere),
    "hang" (accepts, never answers), "cut" (drops the connection mid-stream), "stall"
    (goes silent mid-stream). With prefix_events it reports the prompt blocks it
    serves, hashed as an engine keys them."""

    def __init__(self, kind: str = "worker", prefix_events: bool = False) -> None:
        super().__init__()
        self.kind, self.prefix_events = kind, prefix_events
        self.mode = "ok"
        self.served = 0
        self.epoch = "epoch-1"
        self.log: list[dict] = []  # KV events, seq = index + 1
        self.stored: dict[str, dict] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def restart(self) -> None:
        """As a restarted worker: a new epoch and an empty cache."""
        self.epoch, self.log, self.stored = self.epoch + "+", [], {}

    def apps(self) -> list[tuple[web.Application, int]]:
        app = web.Application(middlewares=[self._faults])
        if self.kind == "worker":
            app.router.add_get("/health", lambda r: web.json_response({"epoch": self.epoch}))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/kvgate/v1/generate", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/kvgate/v1/stats", self._stats)
        app.router.add_get("/kvgate/v1/kv_events", self._kv_events)
        return [(app, self.port)]

    @web.middleware
    async def _faults(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if self.mode == "500":
            return web.Response(status=500, text="Internal Server Error")
        if self.mode == "garbage":
            return web.Response(text='{"not json', content_type="application/json")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        entry = {"id": MODEL, "object": "model", "max_model_len": 4096}
        if self.kind == "worker":
            entry["kvgate"] = {
                "backend": "fake",
                "block_size": 16 if self.prefix_events else None,
                "prefix_events": self.prefix_events,
                "epoch": self.epoch,
            }
        return web.json_response({"object": "list", "data": [entry]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        return web.json_response(
            {"tokens": [1000 + zlib.crc32(w.encode()) % 30000 for w in text.split()]}
        )

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(BackendStats("fake").__dict__)

    async def _kv_events(self, request: web.Request) -> web.Response:
        epoch, after = request.query["epoch"], int(request.query["after"])
        for _ in range(20):  # a long poll of a second at most
            if epoch != self.epoch or len(self.log) != after:
                break
            await asyncio.sleep(0.05)
        resync = epoch != self.epoch or after > len(self.log)
        events = list(self.stored.values()) if resync else self.log[after:]
        reply = {"epoch": self.epoch, "seq": len(self.log), "resync": resync, "events": events}
        return web.json_response(reply)

    def _store(self, ids: list[int], salt: str | None) -> int:
        """Store the prompt's full blocks; the number of its tokens cached before."""
        hashes = [h.hex() for h in hash_blocks(ids, 16, salt)]
        cached = 16 * sum(1 for h in hashes if h in self.stored)
        for parent, h in zip([None, *hashes], hashes, strict=False):
            if h not in self.stored:
                event = {
                    "kind": "stored",
                    "replica": "fake",
                    "block_hash": h,
                    "parent_hash": parent,
                    "cache_salt": salt,
                    "num_tokens": 16,
                    "at": time.time(),
                }
                self.stored[h] = event
                self.log.append(event)
        return cached

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        worker = request.path.startswith("/kvgate")
        n = body["sampling"]["max_tokens"] if worker else body["max_tokens"]
        prompt = body["prompt_token_ids"] if worker else body["prompt"]
        cached = self._store(prompt, body.get("cache_salt")) if self.prefix_events else 0
        self.served += 1
        kind = "application/x-ndjson" if worker else "text/event-stream"
        resp = web.StreamResponse(headers={"Content-Type": kind})
        await resp.prepare(request)
        for i in range(n):
            if i == CHUNKS_BEFORE_FAULT and self.mode == "cut":
                request.transport.close()
                return resp
            if i == CHUNKS_BEFORE_FAULT and self.mode == "stall":
                await asyncio.sleep(3600)
            last = i == n - 1
            if worker:
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n,
                    "cached_tokens": cached,
                    "counted_by": "engine",
                }
                line = {
                    "token_ids": [7],
                    "text": f" w{i}",
                    "finish_reason": "length" if last else None,
                    "usage": usage if last else None,
                    "logprobs": None,
                }
                await resp.write(json.dumps(line).encode() + b"\n")
            else:
                choice = {"text": f" w{i}", "index": 0, "finish_reason": "length" if last else None}
                await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        if not worker:
            await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def gateway_over(tmp_path: Path) -> Iterator[Callable[..., LiveGateway]]:
    started: list[LiveGateway] = []

    def start(upstreams: list[FakeUpstream], **options: object) -> LiveGateway:
        gw = start_gateway(tmp_path, config=remote_config([u.url for u in upstreams], **options))
        started.append(gw)
        wait_until(lambda: all(backend_health(gw).values()), "every replica is healthy")
        return gw

    yield start
    for gw in started:
        gw.stop()


def assert_openai_error(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


def stream_events(client: httpx.Client, key: str, max_tokens: int = 6) -> list[dict]:
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": max_tokens, "stream": True}
    events = []
    with client.stream(
        "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            assert_openai_error(resp)
            return [resp.json()]
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def text_of(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


@pytest.mark.parametrize("kind", ["worker", "openai"])
@pytest.mark.parametrize("mode", FAULTS_BEFORE_OUTPUT)
def test_failing_replica_leaves_the_rotation_and_comes_back(gateway_over, kind, mode):
    with FakeUpstream(kind) as bad, FakeUpstream(kind) as good:
        gw = gateway_over([bad, good])
        _, key = gw.tenant_key("acme", max_concurrent=1)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        bad.mode = mode
        for _ in range(4):  # a request sent to the failing one is retried on the other
            comp = client.completions.create(model=MODEL, prompt="a b c", max_tokens=3)
            assert comp.choices[0].text == " w0 w1 w2"
        wait_until(lambda: not backend_health(gw)[name_of(gw, bad.port)], "it leaves")
        assert backend_health(gw)[name_of(gw, good.port)]
        served = bad.served
        bad.mode = "ok"
        wait_until(lambda: backend_health(gw)[name_of(gw, bad.port)], "it comes back")
        for _ in range(4):
            client.completions.create(model=MODEL, prompt="a b c", max_tokens=3)
        assert bad.served > served


@pytest.mark.parametrize("kind", ["worker", "openai"])
@pytest.mark.parametrize("mode", FAULTS_BEFORE_OUTPUT)
def test_sole_failing_upstream_gives_an_openai_shaped_503(gateway_over, kind, mode):
    with FakeUpstream(kind) as up:
        gw = gateway_over([up])
        _, key = gw.tenant_key("acme", max_concurrent=1)
        up.mode = mode
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            for _ in range(2):  # the first fails as it goes, the second may find it down
                resp = http.post(
                    "/v1/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": MODEL, "prompt": "a b", "max_tokens": 3},
                )
                assert_openai_error(resp)
                events = stream_events(http, key)
                assert "error" in events[-1] and events[-1]["error"]["message"]
                assert not any(e.get("choices") for e in events)  # no output before it


@pytest.mark.parametrize("kind", ["worker", "openai"])
@pytest.mark.parametrize("mode", ["cut", "stall"])
def test_upstream_stopping_mid_stream_ends_it_with_an_error_event(gateway_over, kind, mode):
    with FakeUpstream(kind) as up:
        gw = gateway_over([up])
        tenant, key = gw.tenant_key("acme", max_concurrent=1)
        up.mode = mode
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            events = stream_events(http, key)
            assert text_of(events) == " w0 w1"
            assert events[-1]["error"]["message"] and set(events[-1]["error"]) >= {"type", "code"}
            up.mode = "ok"  # the reservation settled: one at a time is allowed again
            wait_until(lambda: all(backend_health(gw).values()), "the upstream is healthy")
            assert text_of(stream_events(http, key, 2)) == " w0 w1"
        db = sqlite3.connect(Path(gw.env["KVGATE_DATABASE_URL"].split(":///")[1]))
        rows = db.execute(
            "SELECT status, completion_tokens, counted_by FROM usage_records "
            "WHERE tenant_id = ? ORDER BY id",
            (tenant["id"],),
        ).fetchall()
        counted_by = "engine" if kind == "worker" else "gateway"
        assert rows == [(503, CHUNKS_BEFORE_FAULT, counted_by), (200, 2, counted_by)]


def held_blocks(gw: LiveGateway) -> set[str]:
    """The replicas the gateway's prefix catalog says hold blocks."""
    report = httpx.get(gw.url + "/admin/prefixes", headers=gw.admin_headers).json()
    return {row["replica"] for row in report["prefixes"]}


def test_worker_restart_resyncs_the_catalog(gateway_over):
    with FakeUpstream(prefix_events=True) as a, FakeUpstream(prefix_events=True) as b:
        gw = gateway_over([a, b])
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        prompt = " ".join(f"word{i}" for i in range(40))  # two full blocks of 16
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        holder, other = (a, b) if a.served else (b, a)
        holds = {name_of(gw, holder.port)}
        wait_until(lambda: held_blocks(gw) == holds, "the catalog has its blocks")
        for _ in range(3):  # precise prefix routing: the replica holding the blocks
            comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert comp.usage.prompt_tokens_details.cached_tokens == 32
        assert (holder.served, other.served) == (4, 0)
        holder.restart()
        wait_until(lambda: held_blocks(gw) == set(), "the catalog forgets the restarted one's")


def test_gateway_restart_rebuilds_the_catalog_from_the_workers(gateway_over):
    with FakeUpstream(prefix_events=True) as up:
        gw = gateway_over([up])
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        client.completions.create(model=MODEL, prompt="w " * 40, max_tokens=2)
        holds = {name_of(gw, up.port)}
        wait_until(lambda: held_blocks(gw) == holds, "the catalog has its blocks")
        gw.stop()
        gw = gateway_over([up])  # the same database; the worker kept its cache
        wait_until(lambda: held_blocks(gw) == holds, "the new gateway learns them again")


@pytest.fixture
def two_workers(tmp_path) -> Iterator[tuple[LiveGateway, list[int], list[subprocess.Popen]]]:
    with gateway_over_workers(tmp_path, 2, context_length=None) as running:
        yield running


async def stream_to_the_end(
    client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event
) -> tuple[str, int, bool]:
    """(request id, chunks read, whether it finished) of a 100-token stream."""
    ids: list[str] = []
    try:
        chunks = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=100, stream=True
        )
        async for chunk in chunks:
            ids.append(chunk.id)
            started.set()
    except openai.APIError:  # the error event
        return ids[0], len(ids), False
    return ids[0], len(ids), True


async def some_requests(client: openai.AsyncOpenAI, n: int = 4) -> list[int]:
    """Completion tokens of n requests sent at once."""
    done = await asyncio.gather(
        *(client.completions.create(model=MODEL, prompt="hi", max_tokens=2) for _ in range(n))
    )
    return [c.usage.completion_tokens for c in done]


async def test_kill_9_of_a_worker_mid_stream(two_workers, tmp_path):
    gw, ports, workers = two_workers
    _, key = gw.tenant_key("acme", max_concurrent=4)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    started = [asyncio.Event() for _ in range(4)]
    tasks = [
        asyncio.create_task(stream_to_the_end(client, f"s {i}", e)) for i, e in enumerate(started)
    ]
    await asyncio.gather(*(e.wait() for e in started))
    workers[0].send_signal(signal.SIGKILL)
    results = await asyncio.gather(*tasks)  # none hangs
    broken = [r for r in results if not r[2]]
    assert broken and len(broken) < 4  # the other worker's streams finished
    assert all(n == 100 for _, n, ok in results if ok)
    db = sqlite3.connect(tmp_path / "kvgate.db")
    for request_id, n, _ in broken:  # settled to what was delivered
        sql = "SELECT status, completion_tokens FROM usage_records WHERE request_id = ?"
        assert db.execute(sql, (request_id,)).fetchone() == (503, n)
    # it leaves the rotation; four at once (every slot was given back) go to the other
    wait_until(lambda: not backend_health(gw)[name_of(gw, ports[0])], "it leaves")
    assert await some_requests(client) == [2] * 4
    workers[0] = start_worker(tmp_path, ports[0])  # a new epoch, an empty cache
    wait_until(lambda: backend_health(gw)[name_of(gw, ports[0])], "it comes back")
    await some_requests(client)
    assert (await asyncio.to_thread(worker_stats, ports[0]))["prefix_queries"] > 0  # it serves


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_approximate_prefix_routing_over_upstreams_without_events(tmp_path, policy):
    """Third-party upstreams report no cache: the gateway's record of what it sent where
    keeps a shared prompt on one replica; round robin (the control) spreads it."""
    with FakeUpstream(kind="openai") as a, FakeUpstream(kind="openai") as b:
        config = remote_config([a.url, b.url]) + f'\n[server]\nrouter_policy = "{policy}"\n'
        gw = start_gateway(tmp_path, config=config)
        try:
            wait_until(lambda: all(backend_health(gw).values()), "every replica is healthy")
            _, key = gw.tenant_key("acme")
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            system = " ".join(f"rule{i}" for i in range(40))  # two full blocks of 16
            client.completions.create(model=MODEL, prompt=system + " first", max_tokens=2)
            holder = a if a.served else b
            if policy == "prefix":
                holds = {name_of(gw, holder.port)}
                wait_until(lambda: held_blocks(gw) == holds, "the record reached the catalog")
            for i in range(5):
                client.completions.create(model=MODEL, prompt=f"{system} q{i}", max_tokens=2)
        finally:
            gw.stop()
    if policy == "prefix":
        assert holder.served == 6
    else:
        assert a.served == b.served == 3
