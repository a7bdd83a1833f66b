"""A real `kvgate serve` process, the real `openai` client, restarts and kill -9."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY, LiveGateway, start_gateway


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    """One gateway for the tests that each make a tenant of their own (its limits, its
    prefix-cache salt) and need no fresh database: a start is 1.5-2 CPU-s."""
    gw = start_gateway(tmp_path_factory.mktemp("live"), "--backend", "fake")
    yield gw
    gw.stop()


def test_openai_client_chat_completions_and_streaming(shared):
    _, key = shared.tenant_key("acme")
    client = openai.OpenAI(base_url=shared.url + "/v1", api_key=key)
    assert [m.id for m in client.models.list()] == ["fake-model"]

    chat = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    assert chat.usage.prompt_tokens_details.cached_tokens == 0

    comp = client.completions.create(model="fake-model", prompt="once upon", max_tokens=4)
    assert comp.choices[0].text and comp.usage.completion_tokens == 4

    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 7
    assert chunks[-1].usage.completion_tokens == 7

    extras = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        extra_body={"top_k": 5, "min_p": 0.1},
    )
    assert extras.usage.completion_tokens == 3


def test_openai_client_errors(shared):
    _, key = shared.tenant_key("acme-limited", rpm=1)
    messages = [{"role": "user", "content": "x"}]
    bad = openai.OpenAI(base_url=shared.url + "/v1", api_key="kvg-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="fake-model", messages=messages)
    client = openai.OpenAI(base_url=shared.url + "/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="fake-model", messages=messages, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="fake-model", messages=messages, max_tokens=1)
    assert e.value.response.headers["retry-after"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages)


def test_restart_keeps_tenants_keys_and_usage(tmp_path):
    gw = start_gateway(tmp_path, "--backend", "fake")
    try:
        tenant, key = gw.tenant_key("acme", daily_tokens=100)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        client.completions.create(model="fake-model", prompt="a b c d", max_tokens=50)
    finally:
        gw.stop()
    gw = start_gateway(tmp_path, "--backend", "fake")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        # 54 of the 100 daily tokens were used before the restart: 50 more do not fit
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="fake-model", prompt="a b c d", max_tokens=50)
        client.completions.create(model="fake-model", prompt="a b c d", max_tokens=10)
        usage = httpx.get(gw.url + "/admin/usage", headers=gw.admin_headers).json()
        assert usage["total"]["requests"] == 2
        assert usage["total"]["completion_tokens"] == 60
    finally:
        gw.stop()


def test_kill_9_under_load_loses_no_usage_row(tmp_path):
    gw = start_gateway(tmp_path, "--backend", "fake")
    _, key = gw.tenant_key("acme")
    completed: list[str] = []

    async def client_loop(http: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "fake-model", "prompt": f"load {i}", "max_tokens": 8}
        headers = {"Authorization": f"Bearer {key}"}
        while True:
            try:
                async with http.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
                    data = await r.json()
                if r.status == 200:
                    completed.append(data["id"])
            except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError):
                return

    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(client_loop(http, i)) for i in range(16)]
            while len(completed) < 300:
                await asyncio.sleep(0.01)
            gw.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(run())
    gw.proc.wait()
    db = sqlite3.connect(tmp_path / "kvgate.db")
    recorded = {row[0] for row in db.execute("SELECT request_id FROM usage_records")}
    db.close()
    assert len(completed) >= 300
    missing = [rid for rid in completed if rid not in recorded]
    assert missing == []


def test_cli_tenants_and_keys(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    cli = [sys.executable, "-m", "gateway.cli", "--database-url", url]

    def kvgate(*args: str) -> str:
        out = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "up to date" in kvgate("db", "upgrade")
    create = ["tenants", "create", "cli-co", "--rpm", "5", "--models", "fake-model"]
    tenant = json.loads(kvgate("--json", *create))
    assert tenant["rpm"] == 5 and tenant["models"] == ["fake-model"]
    updated = json.loads(kvgate("--json", "tenants", "update", tenant["id"], "--tpm", "900"))
    assert updated["tpm"] == 900 and updated["rpm"] == 5
    assert "cli-co" in kvgate("tenants", "list")
    key = json.loads(kvgate("--json", "keys", "create", tenant["id"], "--name", "ci"))
    assert key["key"].startswith("kvg-")
    listed = json.loads(kvgate("--json", "keys", "list", tenant["id"]))
    assert [k["id"] for k in listed] == [key["id"]] and "key" not in listed[0]
    revoked = json.loads(kvgate("--json", "keys", "revoke", key["id"]))
    assert revoked["revoked_at"] is not None
    assert json.loads(kvgate("--json", "usage"))["total"]["requests"] == 0
    kvgate("tenants", "delete", tenant["id"])
    assert "cli-co" not in kvgate("tenants", "list")
    out = subprocess.run([*cli, "tenants", "delete", "t_missing"], capture_output=True, text=True)
    assert out.returncode == 1 and "no tenant" in out.stderr


def test_generated_admin_key_is_printed_once(tmp_path):
    env = {"KVGATE_ADMIN_KEY": ""}
    gw = start_gateway(tmp_path, "--backend", "fake", extra_env=env)
    gw.stop()
    first = gw.log.read_text()
    assert "shown only this once" in first and "kvg-" in first
    key = next(line.split("=")[1] for line in first.splitlines() if "export ADMIN=" in line)
    gw = start_gateway(tmp_path, "--backend", "fake", extra_env=env)
    try:
        assert "shown only this once" not in gw.log.read_text()
        r = httpx.get(gw.url + "/admin/tenants", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        r = httpx.get(gw.url + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 401
    finally:
        gw.stop()
