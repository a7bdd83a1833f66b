"""`kvgate worker` as a real process on loopback: every route over real HTTP, the `openai`
client on its /v1/completions, aborts on disconnect, and the KV event log's long poll
(with the tiny random-weight model on the gpu backend, whose engine reports events)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine_api.block_hash import hash_blocks
from engine_api.records import GenChunk, KVEvent
from gateway.backends import BackendSpec
from gateway.backends.fake import FakeBackend
from gateway.worker.events import EventLog
from tests.backend_gpu.tiny_models import save_tiny_model

TOKEN = "worker-token-" + "t" * 32
KV_TIER_SECRET = "kv-tier-secret-" + "s" * 32
MODEL = "fake-model"


@dataclass
class LiveWorker:
    url: str
    proc: subprocess.Popen
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_worker(tmp_path: Path, *args: str, timeout: float = 120) -> LiveWorker:
    """`kvgate worker --port 0 ARGS` with the test token; waits for its ready line."""
    log = tmp_path / f"worker-{time.monotonic_ns()}.log"
    # the KV tiers' secret, as a supervisor passes it: paired workers share it
    env = dict(os.environ, KVGATE_WORKER_TOKEN=TOKEN, KVGATE_KV_TIER_SECRET=KV_TIER_SECRET)
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--port", "0", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("kvgate worker: listening on "):
                return LiveWorker(line.rsplit(" ", 1)[1], proc, log)
        if proc.poll() is not None:
            raise RuntimeError(f"kvgate worker exited early:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"kvgate worker did not start in {timeout}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[LiveWorker]:
    # 200 tokens/s: a long request is still streaming when the client hangs up
    options = json.dumps({"tokens_per_second": 200})
    w = start_worker(tmp_path_factory.mktemp("worker"), "--backend", "fake", "--options", options)
    yield w
    w.stop()


def http(w: LiveWorker, token: str | None = TOKEN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=w.url, headers=headers, timeout=30)


def gen_body(prompt: list[int], max_tokens: int, **fields) -> dict:
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}
    return {
        "request_id": f"r{time.monotonic_ns()}",
        "model": MODEL,
        "prompt_token_ids": prompt,
        "sampling": sampling,
    } | fields


async def generate(w: LiveWorker, body: dict) -> list[GenChunk]:
    async with http(w) as c:
        r = await c.post("/kvgate/v1/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [GenChunk.from_dict(json.loads(line)) for line in r.text.splitlines()]


async def test_token_is_required_except_on_health(worker):
    async with http(worker, token=None) as anon:
        health = await anon.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["epoch"]
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/kvgate/v1/generate"),
            ("GET", "/kvgate/v1/kv_events"),
            ("POST", "/tokenize"),
        ]:
            r = await anon.request(method, path, json=gen_body([1001], 1))
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    async with http(worker, token="wrong-" + TOKEN) as wrong:
        r = await wrong.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    async with http(worker) as c:
        assert (await c.get("/v1/models")).status_code == 200


async def test_models_describe_the_worker(worker):
    async with http(worker) as c:
        epoch = (await c.get("/health")).json()["epoch"]
        models = (await c.get("/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["max_model_len"] == 4096
    assert card["kvgate"] == {
        "backend": "fake",
        "block_size": None,
        "prefix_events": False,
        "epoch": epoch,
        "role": "both",
    }


async def test_tokenize_is_the_adapters_render_and_detokenize_inverts_output(worker):
    fake = FakeBackend(BackendSpec("fake", "fake", "", MODEL))
    prompt = "the worker renders exactly as the gateway would"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with http(worker) as c:
        r = await c.post("/tokenize", json={"model": MODEL, "prompt": prompt})
        assert r.json() == {
            "tokens": await fake.render(MODEL, prompt),
            "count": len(prompt.split()),
            "max_model_len": 4096,
        }
        r = await c.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert r.json()["tokens"] == await fake.render(MODEL, messages)
        r = await c.post("/tokenize", json={"model": MODEL, "prompt": "x", "messages": messages})
        assert r.status_code == 400
        r = await c.post("/tokenize", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        chunks = await generate(worker, gen_body([1001, 1002], 6))
        ids = [t for ch in chunks for t in ch.token_ids]
        r = await c.post("/detokenize", json={"model": MODEL, "tokens": ids})
        assert r.json() == {"prompt": "".join(ch.text for ch in chunks)}
        r = await c.post("/detokenize", json={"model": MODEL, "tokens": [10**6]})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


async def test_openai_client_completions(worker):
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key=TOKEN, max_retries=0)
    whole = await client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=5, temperature=0
    )
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == 5
    assert whole.choices[0].finish_reason == "length"
    stream = await client.completions.create(
        model=MODEL,
        prompt="once upon a time",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5

    ids = list(range(1001, 1033))  # two full blocks of the fake's 16
    first = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, extra_body={"cache_salt": "tenant-a"}
    )
    assert first.usage.prompt_tokens == 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, extra_body={"cache_salt": "tenant-a", "priority": 1}
    )
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    other = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, extra_body={"cache_salt": "tenant-b"}
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0


async def test_completions_refuse_what_one_engine_call_cannot_serve(worker):
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="a", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=["a", "b"])
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="a", max_tokens=5000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="a")


async def test_generate_streams_records_ending_with_usage(worker):
    chunks = await generate(worker, gen_body([1001, 1002, 1003], 4))
    assert [len(ch.token_ids) for ch in chunks] == [1, 1, 1, 1]
    assert all(ch.finish_reason is None and ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 4
    client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key=TOKEN, max_retries=0)
    same = await client.completions.create(
        model=MODEL, prompt=[1001, 1002, 1003], max_tokens=4, temperature=0
    )
    assert same.choices[0].text == "".join(ch.text for ch in chunks)


async def test_generate_errors_before_output_are_http_errors(worker):
    async with http(worker) as c:
        r = await c.post("/kvgate/v1/generate", json=gen_body([1001, 1002], 5000))
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert (error["prompt_tokens"], error["max_tokens"], error["context_length"]) == (
            2,
            5000,
            4096,
        )
        r = await c.post("/kvgate/v1/generate", json=gen_body([1001], 2, surprise=1))
        assert r.status_code == 400 and "'surprise'" in r.json()["error"]["message"]
        bad = gen_body([1001], 2)
        bad["sampling"]["top_p"] = 0
        r = await c.post("/kvgate/v1/generate", json=bad)
        assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
        r = await c.post("/kvgate/v1/generate", json=gen_body([1001], 2, model="nope"))
        assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


async def test_closing_the_stream_aborts_the_request(worker):
    max_tokens = 4000  # 20 s at the fixture's 200 tokens/s, were it not aborted
    async with http(worker) as c:
        async with c.stream("POST", "/kvgate/v1/generate", json=gen_body([1001], max_tokens)) as r:
            lines = r.aiter_lines()
            GenChunk.from_dict(json.loads(await anext(lines)))
            GenChunk.from_dict(json.loads(await anext(lines)))
            assert (await c.get("/kvgate/v1/stats")).json()["running"] == 1
        for _ in range(300):
            stats = (await c.get("/kvgate/v1/stats")).json()
            if stats["running"] == 0:
                break
            await asyncio.sleep(0.05)
    assert stats["running"] == 0
    # the fake counts what a request generated when it ends: far fewer than max_tokens
    assert stats["gen_tokens_per_s"] * 10 < max_tokens / 2


async def test_kv_events_without_prefix_events(worker):
    async with http(worker) as c:
        epoch = (await c.get("/health")).json()["epoch"]
        r = await c.get("/kvgate/v1/kv_events", params={"epoch": epoch, "after": 0, "wait": 0})
        assert r.json() == {"epoch": epoch, "seq": 0, "resync": False, "events": []}
        r = await c.get("/kvgate/v1/kv_events", params={"epoch": "old", "after": 7, "wait": 0})
        assert r.json() == {"epoch": epoch, "seq": 0, "resync": True, "events": []}
        for params in ({"after": -1}, {"after": "x"}, {"wait": 31}, {"wait": "nan"}):
            r = await c.get("/kvgate/v1/kv_events", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] in params


def test_a_public_worker_needs_a_token():
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_WORKER_TOKEN"}
    args = ["worker", "--host", "0.0.0.0", "--port", "0", "--backend", "fake"]
    cmd = [sys.executable, "-m", "gateway.cli", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "without a worker token" in done.stderr and "listening" not in done.stdout


# -- the event log on its own ------------------------------------------------------------


def event(kind: str, block: str) -> KVEvent:
    return KVEvent(kind, "r", block, None, None, 16, 0.0)


async def test_event_log_resumes_or_resyncs():
    log = EventLog("e1", capacity=3)
    assert (await log.poll("e1", 0, 0)).resync is False  # a new log is not a resync
    log.append([event("stored", "a"), event("stored", "b"), event("removed", "a")])
    log.append([event("stored", "c"), event("stored", "d")])  # 5 events, the last 3 kept
    reply = await log.poll("e1", 2, 0)
    assert (reply.seq, reply.resync) == (5, False)
    assert [(e.kind, e.block_hash) for e in reply.events] == [
        ("removed", "a"),
        ("stored", "c"),
        ("stored", "d"),
    ]
    for epoch, after in [("e1", 1), ("e0", 5), ("e1", 6)]:  # too old, restarted, ahead
        reply = await log.poll(epoch, after, 0)
        assert reply.resync and reply.seq == 5
        assert sorted(e.block_hash for e in reply.events) == ["b", "c", "d"]
        assert {e.kind for e in reply.events} == {"stored"}


async def test_event_log_long_poll_waits_for_the_next_event():
    log = EventLog("e1")
    log.append([event("stored", "a")])
    waiting = asyncio.create_task(log.poll("e1", 1, 30))
    await asyncio.sleep(0)
    assert not waiting.done()
    log.append([event("stored", "b")])
    reply = await waiting
    assert (reply.seq, [e.block_hash for e in reply.events]) == (2, ["b"])


# -- a gpu-backend worker: the engine's KV events over the long poll ----------------------

PROMPT = "Paged attention stores keys and values in fixed-size blocks. " * 3


def poll_events(c: httpx.AsyncClient, **params) -> Awaitable[httpx.Response]:
    return c.get("/kvgate/v1/kv_events", params=params)


def stored_blocks(reply: dict) -> set[str]:
    """The blocks a kv_events reply says were stored."""
    return {e["block_hash"] for e in reply["events"] if e["kind"] == "stored"}


@pytest.mark.slow
async def test_kv_events_of_a_gpu_worker(tmp_path):
    model = save_tiny_model("llama", str(tmp_path))
    options = {
        "enable_prefix_caching": True,
        "enable_kv_events": True,
        "seed": 1,
        "max_num_batched_tokens": 64,
        "kv_cache_memory_bytes": 8 << 20,
    }
    args = ["--backend", "gpu", "--model", model, "--served-model-name", "tiny"]
    w = start_worker(tmp_path, *args, "--options", json.dumps(options))
    try:
        async with http(w) as c:
            (card,) = (await c.get("/v1/models")).json()["data"]
            assert card["kvgate"]["prefix_events"] is True
            block, epoch = card["kvgate"]["block_size"], card["kvgate"]["epoch"]
            assert block == 16

            async def generate_and_poll(text: str, salt: str, after: int) -> tuple[dict, list]:
                ids = (await c.post("/tokenize", json={"model": "tiny", "prompt": text})).json()
                poll = asyncio.create_task(poll_events(c, epoch=epoch, after=after, wait=30))
                body = gen_body(ids["tokens"], 2, model="tiny", cache_salt=salt)
                r = await c.post("/kvgate/v1/generate", json=body)
                assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["usage"]
                expected = [h.hex() for h in hash_blocks(ids["tokens"], block, salt)]
                got = (await poll).json()  # woke by the first events: a chunk's, maybe
                # the rest: the worker drains its engine's events in the background, so
                # they may land after the request's last chunk (a busy machine: seconds)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not set(expected) <= stored_blocks(got):
                    more = (await poll_events(c, epoch=epoch, after=got["seq"], wait=1)).json()
                    got = more | {"events": got["events"] + more["events"]}
                return got, expected

            first, blocks_a = await generate_and_poll(PROMPT, "salt-a", 0)
            assert len(blocks_a) >= 2 and not first["resync"] and first["epoch"] == epoch
            events = [KVEvent.from_dict(e) for e in first["events"]]
            assert first["seq"] >= len(blocks_a)
            assert set(blocks_a) <= {e.block_hash for e in events if e.kind == "stored"}

            second, blocks_b = await generate_and_poll(PROMPT, "salt-b", first["seq"])
            assert second["seq"] > first["seq"] and not second["resync"]
            stored = {e["block_hash"] for e in second["events"] if e["kind"] == "stored"}
            assert set(blocks_b) <= stored and not set(blocks_a) & stored  # only new ones

            for params in (
                {"epoch": "before-a-restart", "after": second["seq"]},
                {"epoch": epoch, "after": second["seq"] + 1},
            ):
                snapshot = (await poll_events(c, **params, wait=0)).json()
                assert snapshot["resync"] and snapshot["seq"] == second["seq"]
                held = {e["block_hash"] for e in snapshot["events"]}
                assert set(blocks_a) | set(blocks_b) <= held
                assert {e["kind"] for e in snapshot["events"]} == {"stored"}
    finally:
        w.stop()
