"""Live reload (gateway/reload.py) of a real `kvgate serve` process: POST /admin/reload
adds a backend that then serves and prices the next usage row anew; a config that does
not validate, or changes what needs a restart, is a 400 naming the field with nothing
changed; SIGHUP does the same as the admin call, here removing a backend while a stream
on it is in flight: the stream finishes whole, then the model is gone (404) and the
backend is stopped."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import start_gateway

BACKEND_A = """
[[backends]]
name = "a"
type = "fake"
model = "m-a"
options = { tokens_per_second = 20 }
"""
BACKEND_B = """
[[backends]]
name = "b"
type = "fake"
model = "m-b"
"""
SEEDED_B = BACKEND_B + "options = { seed = 7 }\n"  # b with other options


def _price(output_usd: int) -> str:
    return f'[prices."m-a"]\ninput = 1\noutput = {output_usd}\n'


def _spend(db: Path, request_id: str) -> tuple[int, int, int]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT prompt_tokens, completion_tokens, spend_nano_usd FROM usage_records "
            "WHERE request_id = ?",
            (request_id,),
        ).fetchone()


def _priced_at(gw, client: openai.OpenAI, db: Path, output_usd: int) -> bool:
    """A request to m-a, and whether its usage row is priced at `output_usd` per million
    output tokens (input: 1 USD per million, i.e. 1000 nanodollars a token)."""
    out = client.completions.create(model="m-a", prompt="price me", max_tokens=3)
    prompt, completion, spend = _spend(db, out.id)
    return spend == prompt * 1000 + completion * output_usd * 1000


def _reload(gw) -> httpx.Response:
    return httpx.post(gw.url + "/admin/reload", headers=gw.admin_headers, timeout=60)


def test_reload_and_sighup(tmp_path):
    db = tmp_path / "kvgate.db"
    gw = start_gateway(tmp_path, config=_price(2) + BACKEND_A)
    config = next(tmp_path.glob("kvgate-*.toml"))
    try:
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        assert _priced_at(gw, client, db, 2)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="m-b", prompt="hi", max_tokens=2)

        config.write_text(_price(4) + BACKEND_A + BACKEND_B)
        done = _reload(gw)
        assert done.status_code == 200, done.text
        body = done.json()
        assert body["added"] == ["b"] and body["removed"] == [] == body["replaced"]
        assert set(body["changed"]) == {"prices", "backends"}
        out = client.completions.create(model="m-b", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert _priced_at(gw, client, db, 4)

        # an entry whose options changed is replaced: its successor serves its model
        config.write_text(_price(4) + BACKEND_A + SEEDED_B)
        done = _reload(gw)
        assert done.status_code == 200, done.text
        assert done.json()["replaced"] == ["b"] and done.json()["changed"] == ["backends"]
        out = client.completions.create(model="m-b", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens == 2

        for broken, field in [
            ('[server]\nfairness = "bogus"\n', "fairness"),  # does not validate
            ("[server]\nkey_cache_ttl_s = 9.0\n", "key_cache_ttl_s"),  # needs a restart
            ("[server\n", "line 1"),  # does not parse
        ]:
            config.write_text(broken + _price(8) + BACKEND_A + SEEDED_B)
            refused = _reload(gw)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert field in error["message"] and error["code"] == "invalid_config"
            assert _priced_at(gw, client, db, 4)  # nothing changed
            out = client.completions.create(model="m-b", prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens == 2

        asyncio.run(_remove_a_by_sighup(gw, key, config))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="m-a", prompt="hi", max_tokens=2)
        out = client.completions.create(model="m-b", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
        deadline = time.monotonic() + 30
        while "backends a stopped" not in gw.log.read_text():
            assert time.monotonic() < deadline, "the removed backend was not stopped"
            time.sleep(0.1)
    finally:
        gw.stop()


async def _remove_a_by_sighup(gw, key: str, config: Path) -> None:
    """A stream on backend a, in flight while SIGHUP's reload removes a: it finishes."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    stream = await client.completions.create(
        model="m-a", prompt="a long one", max_tokens=30, stream=True
    )
    pieces, finish = 0, None
    async for chunk in stream:
        pieces += bool(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if pieces == 1:
            await asyncio.to_thread(config.write_text, SEEDED_B)
            gw.proc.send_signal(signal.SIGHUP)
            async with httpx.AsyncClient(base_url=gw.url + "/v1", timeout=30) as http:
                auth = {"Authorization": f"Bearer {key}"}
                deadline = time.monotonic() + 30
                while "m-a" in [
                    m["id"] for m in (await http.get("/models", headers=auth)).json()["data"]
                ]:
                    assert time.monotonic() < deadline, "SIGHUP did not reload"
                    await asyncio.sleep(0.05)
    assert finish == "length" and pieces == 30
