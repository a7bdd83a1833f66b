"""/tokenize, /detokenize and Anthropic's count_tokens against rpm (issue 45, item 9): none
is billed, yet each is a request of the tenant's and its key's rpm, as any request is; a
tenant whose minute is spent gets the 429 and headers a completion gets, before its body is
read. On the SQLite gateway's counters and on PostgreSQL's, with the real `anthropic`
client for count_tokens."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from tests.conftest import PG_URL, away_from_minute_boundary

RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg)])
def store(request) -> dict:
    """Where the quota's counters are: the gateway's own (SQLite), or PostgreSQL's."""
    if request.param == "sqlite":
        return {}
    return {"database_url": PG_URL, "database_schema": request.getfixturevalue("pg_schema")}


@pytest.fixture
async def gw(store, make_gateway):
    """A gateway that gives up on a body after 5 s: a request refused only once its body
    was read whole would get that 408, not its 429."""
    return await make_gateway(body_timeout_s=5, **store)


def claude(gw, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


async def post(gw, key: str, path: str, body: dict) -> tuple[int, dict, dict]:
    async with await gw.post(path, key, body) as r:
        return r.status, dict(r.headers), await r.json()


async def test_each_is_a_request_of_the_minute_and_refused_like_a_completion(gw):
    tenant, key = await gw.tenant(rpm=4)
    await away_from_minute_boundary()
    status, headers, body = await post(
        gw, key, "/tokenize", {"model": "fake-model", "prompt": "a b"}
    )
    assert status == 200 and body["count"] == 2
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == (
        "4",
        "3",
    )
    detokenize = {"model": "fake-model", "tokens": [1, 2]}
    status, headers, _ = await post(gw, key, "/detokenize", detokenize)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "2"
    raw = await claude(gw, key).messages.with_raw_response.count_tokens(
        model="fake-model", messages=MESSAGES
    )
    assert (await raw.parse()).input_tokens > 0 and raw.headers[
        "x-ratelimit-remaining-requests"
    ] == "1"

    # the three took three of the minute's four requests: one completion is left
    async with await gw.chat(key, max_tokens=2) as r:
        assert r.status == 200
    async with await gw.chat(key, max_tokens=2) as r:
        chat_status, chat_headers, refusal = r.status, r.headers, await r.json()
    assert chat_status == 429
    for path, body in (
        ("/tokenize", {"model": "fake-model", "prompt": "a"}),
        ("/detokenize", detokenize),
    ):
        status, headers, error = await post(gw, key, path, body)
        assert status == 429, error
        assert {k: v for k, v in error["error"].items() if k != "message"} == {
            k: v for k, v in refusal["error"].items() if k != "message"
        }
        assert "requests per minute (RPM)" in error["error"]["message"]
        for name in ("Retry-After", *RATE_HEADERS):
            assert name in headers and name in chat_headers, name
        assert headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(anthropic.RateLimitError) as refused:
        await claude(gw, key).messages.count_tokens(model="fake-model", messages=MESSAGES)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == "4"

    # billed nothing: the one completion is the only usage row
    _, usage = await gw.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    assert usage["total"]["requests"] == 1


async def test_a_keys_own_rpm_counts_them_too(gw):
    tenant, _ = await gw.tenant()
    status, made = await gw.admin("POST", f"/admin/tenants/{tenant['id']}/keys", {"rpm": 2})
    assert status == 201
    key = made["key"]
    await away_from_minute_boundary()
    status, _, _ = await post(gw, key, "/tokenize", {"model": "fake-model", "prompt": "a"})
    assert status == 200
    await claude(gw, key).messages.count_tokens(model="fake-model", messages=MESSAGES)
    status, headers, error = await post(
        gw, key, "/detokenize", {"model": "fake-model", "tokens": [1]}
    )
    assert status == 429 and "this API key's" in error["error"]["message"]
    assert headers["x-ratelimit-limit-requests"] == "2"


async def test_a_refused_tenant_is_refused_before_its_body_arrives(gw):
    """Half of a 4 MiB body is sent and the rest never: the 429 comes all the same."""
    _, key = await gw.tenant(rpm=1)
    await away_from_minute_boundary()
    status, _, _ = await post(gw, key, "/tokenize", {"model": "fake-model", "prompt": "a"})
    assert status == 200
    prompt = "word " * (800 * 1024)
    body = json.dumps({"model": "fake-model", "prompt": prompt}).encode()
    for path in ("/tokenize", "/v1/messages/count_tokens"):
        reader, writer = await asyncio.open_connection(gw.server.host, gw.server.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body[: len(body) // 2])
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        assert status_line.split()[1] == b"429", status_line
