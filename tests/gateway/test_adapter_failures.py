"""LoRA adapters that break, with the fake backend (an adapter whose path is gone since
registration fails to load, as an engine's does) through the real `openai` and
`anthropic` clients: a request priced at admission keeps its price when its adapter is
deleted under it; a load that fails is a 500 `adapter_load_failed` naming the adapter in
each API's shape (chat, a stream, Messages, Responses), bills nothing, is logged once and
shows the adapter `failed` with the reason until a request under it is served again."""

from __future__ import annotations

import logging
import shutil

import anthropic
import openai
import pytest
from sqlalchemy import select

from gateway.db import UsageRecord
from gateway.schemas.responses_admin import AdapterList
from tests.gateway.conftest import fake_backends

MESSAGES = [{"role": "user", "content": "hello there"}]


async def register(gw, name: str, path: str) -> None:
    body = {"name": name, "path": path, "base_model": "fake-model"}
    status, adapter = await gw.admin("POST", "/admin/adapters", body)
    assert status == 201, adapter


async def usage_rows(gw) -> list[UsageRecord]:
    async with gw.state.db.session() as s:
        return list((await s.scalars(select(UsageRecord).order_by(UsageRecord.id))).all())


def openai_client(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_a_request_keeps_the_price_it_was_admitted_at(make_gateway, tmp_path):
    prices = {"fake-model": {"input": 2.0, "output": 4.0}}  # the adapter costs as its base
    gw = await make_gateway(fake_backends(tokens_per_second=50), prices=prices)
    (tmp_path / "sql-lora").mkdir()
    await register(gw, "sql-lora", str(tmp_path / "sql-lora"))
    _, key = await gw.tenant()
    stream = await openai_client(gw, key).chat.completions.create(
        model="sql-lora", messages=MESSAGES, max_tokens=20, stream=True
    )
    deleted = False
    async for _ in stream:
        if not deleted:  # under way: the adapter goes, its request runs on
            assert (await gw.admin("DELETE", "/admin/adapters/sql-lora"))[0] == 200
            deleted = True
    [row] = await usage_rows(gw)
    assert row.model == "sql-lora" and row.status == 200 and row.completion_tokens == 20
    # its base model's price, as when it was admitted: 2 $/M in, 4 $/M out (1000 n$ a
    # token per $/M)
    assert row.spend_nano_usd == 2000 * row.prompt_tokens + 4000 * row.completion_tokens > 0


async def test_an_adapter_that_will_not_load_fails_clearly(make_gateway, tmp_path, caplog):
    gw = await make_gateway()
    path = tmp_path / "sql-lora"
    path.mkdir()
    await register(gw, "sql-lora", str(path))
    _, key = await gw.tenant()
    shutil.rmtree(path)  # its files break after registration
    caplog.set_level(logging.ERROR, logger="kvgate.adapters")
    client = openai_client(gw, key)

    with pytest.raises(openai.InternalServerError) as e:
        await client.chat.completions.create(model="sql-lora", messages=MESSAGES)
    assert e.value.status_code == 500 and e.value.code == "adapter_load_failed"
    assert "'sql-lora'" in e.value.message and str(path) not in e.value.message
    with pytest.raises(openai.APIError, match="'sql-lora' could not be loaded"):
        stream = await client.chat.completions.create(
            model="sql-lora", messages=MESSAGES, stream=True
        )
        async for _ in stream:
            pass
    with pytest.raises(openai.InternalServerError, match="'sql-lora' could not be loaded"):
        await client.responses.create(model="sql-lora", input="hello there")
    messages = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as m:
        await messages.messages.create(model="sql-lora", max_tokens=5, messages=MESSAGES)
    assert m.value.status_code == 500 and m.value.body["error"]["type"] == "api_error"
    assert "'sql-lora' could not be loaded" in m.value.message

    rows = await usage_rows(gw)
    assert len(rows) == 4 and {r.status for r in rows} == {500}
    assert all(r.prompt_tokens == r.completion_tokens == r.spend_nano_usd == 0 for r in rows)
    failures = [r for r in caplog.records if "failed to load" in r.getMessage()]
    assert len(failures) == 4 and "sql-lora" in failures[0].getMessage()
    _, listed = await gw.admin("GET", "/admin/adapters")
    AdapterList.model_validate(listed)  # as the OpenAPI document says
    [adapter] = listed["data"]
    assert adapter["state"] == "failed" and "no such path" in adapter["error"]
    assert gw.backend("fake").stats().healthy  # the backend serves on
    assert (await gw.chat(key)).status == 200

    path.mkdir()  # mended: served again, and shown ready
    answer = await client.chat.completions.create(model="sql-lora", messages=MESSAGES)
    assert answer.choices[0].message.content
    _, listed = await gw.admin("GET", "/admin/adapters")
    assert (listed["data"][0]["state"], listed["data"][0]["error"]) == ("ready", None)
