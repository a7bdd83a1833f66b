"""Live reload (gateway/reload.py) of a real `kvgate serve` process: POST /admin/reload
adds a backend that then serves and prices the next usage row anew; a config that does
not validate, or changes what needs a restart, is a 400 naming the field with nothing
changed; SIGHUP does the same as the admin call, here removing a backend while a stream
on it is in flight: the stream finishes whole, then the model is gone (404) and the
backend is stopped. Values that would break serving (a price past what a usage row
holds, a wrong type, no backend left) are refused on a reload, by SIGHUP, and at
start-up alike, each naming its key. A gateway started without a config file refuses a
reload, saying it has no file to read again."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
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


# values that would break serving, each with the key its refusal names: a price whose
# spend a usage row cannot hold (every request would then fail), wrong TOML types, and no
# backend left (the default model would quietly take the removed ones' place)
BREAKING = [
    ('[prices."m-a"]\ninput = 1\noutput = 1e300\n' + BACKEND_A, "prices.m-a.output"),
    ('[server]\ndrain_timeout_s = "abc"\n' + _price(8) + BACKEND_A, "drain_timeout_s"),
    ("[server]\ndrain_timeout_s = inf\n" + _price(8) + BACKEND_A, "drain_timeout_s"),
    ("[server]\nrouter_policy = 5\n" + _price(8) + BACKEND_A, "router_policy"),
    (
        _price(8) + BACKEND_A.replace("options = { tokens_per_second = 20 }", "options = 5"),
        "backends.a.options",
    ),
    (_price(8) + BACKEND_A.replace('name = "a"', "name = 5"), "backends[0].name"),
    (_price(8) + 'prices = 5\n[[backends]]\nname = "a"\ntype = "fake"\n', "prices"),
    (_price(8), "backends"),
]


def test_reload_refuses_values_that_would_break_serving(tmp_path):
    db = tmp_path / "kvgate.db"
    gw = start_gateway(tmp_path, config=_price(2) + BACKEND_A)
    config = next(tmp_path.glob("kvgate-*.toml"))
    try:
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for broken, field in BREAKING:
            config.write_text(broken)
            refused = _reload(gw)
            assert refused.status_code == 400, (field, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "invalid_config" and field in error["message"], error
            assert _priced_at(gw, client, db, 2)  # the running config stays
        config.write_text('[server]\ndrain_timeout_s = "abc"\n' + _price(8) + BACKEND_A)
        gw.proc.send_signal(signal.SIGHUP)  # logged; no task dies with a traceback
        deadline = time.monotonic() + 30
        while gw.log.read_text().count("config reload refused") <= len(BREAKING):
            assert time.monotonic() < deadline, "SIGHUP's reload was not logged"
            time.sleep(0.1)
        assert _priced_at(gw, client, db, 2)
        assert "Traceback" not in gw.log.read_text()
    finally:
        gw.stop()


def test_a_gateway_without_a_config_file_says_there_is_none_to_read(tmp_path):
    gw = start_gateway(tmp_path, "--backend", "fake")
    try:
        refused = _reload(gw)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_config", error
        assert "without a config file" in error["message"] and "--config" in error["message"]
        gw.proc.send_signal(signal.SIGHUP)  # the same words in the log
        deadline = time.monotonic() + 30
        while gw.log.read_text().count("without a config file") < 2:
            assert time.monotonic() < deadline, "SIGHUP's refusal was not logged"
            time.sleep(0.1)
        assert "config reloaded" not in gw.log.read_text()
    finally:
        gw.stop()


def test_start_up_refuses_them_the_same_way(tmp_path):
    env = dict(os.environ, KVGATE_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'k.db'}")
    config = tmp_path / "kvgate.toml"
    for broken, field in BREAKING:
        config.write_text(broken)
        cmd = [sys.executable, "-m", "gateway.cli", "--config", str(config), "serve"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (field, done.stdout, done.stderr)
        assert "bad configuration" in done.stderr and field in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


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
