"""A streamed chat sends a chunk only when there is something to say (issue 48): text a
parser holds back (a marker's start, a call's closing brace) makes no empty delta, as
vLLM sends none; the first chunk (the role) and the last (the finish) always go, and a
held token's logprobs still go. What the stream says adds up to the whole answer."""

from __future__ import annotations

import json

from gateway.backends import BackendSpec
from studies import gateway_parsers

ON = BackendSpec("on", "fake", "", "on-model", reasoning_parser="qwen3", tool_call_parser="hermes")


def chunks(raw: bytes) -> list[dict]:
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


async def test_held_text_makes_no_empty_chunk(make_gateway):
    gw = await make_gateway([ON])
    _, key = await gw.tenant()
    body = gateway_parsers.body(True, True) | {"model": "on-model"}
    got = chunks(await (await gw.post("/v1/chat/completions", key, body)).read())
    deltas = [c["choices"][0]["delta"] for c in got]
    assert deltas[0]["role"] == "assistant" and got[-1]["choices"][0]["finish_reason"]
    assert all(d for d in deltas[1:-1]), [d for d in deltas if not d]
    # the mock's 81 tokens, less the ones held (markers, the call's last brace)
    assert len(got) < 81
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    args = "".join(
        t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", [])
    )
    whole = await (await gw.post("/v1/chat/completions", key, body | {"stream": False})).json()
    message = whole["choices"][0]["message"]
    assert (
        reasoning == message["reasoning"]
        and args == message["tool_calls"][0]["function"]["arguments"]
    )
    # with logprobs asked for, every token's go out, held or not
    body |= {"logprobs": True}
    got = chunks(await (await gw.post("/v1/chat/completions", key, body)).read())
    tokens = [lp for c in got for lp in (c["choices"][0]["logprobs"] or {}).get("content") or []]
    assert len(tokens) == 81
