"""studies.gateway_parsers' two sides do what its figures claim: "on" reads the reply's
reasoning and call with the parsers named, "off" hands the same text back as content (the
times are the study's business, not a test's)."""

from __future__ import annotations

import json

from gateway.backends import BackendSpec
from studies import gateway_parsers


async def test_on_parses_the_reply_and_off_does_not(make_gateway):
    on = BackendSpec(
        "on", "fake", "", "on-model", reasoning_parser="qwen3", tool_call_parser="hermes"
    )
    off = BackendSpec("off", "fake", "", "off-model")
    gw = await make_gateway([on, off])
    _, key = await gw.tenant()
    r = await gw.post(
        "/v1/chat/completions", key, gateway_parsers.body(True, False) | {"model": "on-model"}
    )
    message = (await r.json())["choices"][0]["message"]
    assert r.status == 200 and message["reasoning"].startswith("The user wants the weather")
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    r = await gw.post(
        "/v1/chat/completions", key, gateway_parsers.body(False, False) | {"model": "off-model"}
    )
    message = (await r.json())["choices"][0]["message"]
    assert r.status == 200 and message["content"] == gateway_parsers.MOCK
    assert not message.get("tool_calls") and not message.get("reasoning")
