"""studies.parser_costs times what the chat route does with a reply: its loops must say
what the route says (the parsed reply's reasoning and call, the plain reply as content),
whole and streamed, or its figures time something else (the times are the study's)."""

from __future__ import annotations

import json
import re

from studies import parser_costs
from studies.gateway_parsers import MOCK


def _deltas(events: list[bytes]) -> list[dict]:
    bodies = [json.loads(e.removeprefix(b"data: ")) for e in events]
    return [c["delta"] for b in bodies for c in b["choices"]]


def test_the_loops_answer_as_the_route_does() -> None:
    on = _deltas(parser_costs.streamed("on"))
    reasoning = "".join(d.get("reasoning", "") for d in on)
    assert reasoning.startswith("The user wants the weather")
    calls = [c for d in on for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    off = _deltas(parser_costs.streamed("off"))
    assert "".join(d.get("content", "") for d in off) == MOCK
    assert not any("tool_calls" in d or "reasoning" in d for d in off)
    [choice] = json.loads(parser_costs.whole("on"))["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"]
    [choice] = json.loads(parser_costs.whole("off"))["choices"]
    assert choice["message"]["content"] == MOCK and choice["finish_reason"] == "stop"


def test_the_encoding_apart_encodes_what_the_stream_sends() -> None:
    """The study's encoding part (`encode`, over the chunks' arguments) makes the bytes the
    streamed loop sends, so its on - off is the route's (call ids aside: they are random)."""
    for side in ("off", "on"):
        args = parser_costs.streamed(side, encode=False)
        bodies = [
            parser_costs.sse(parser_costs.chunk_body(True, "chatcmpl-1", 1, "fake-model", 0, *a))
            for a in args[:-1]
        ]
        sent = parser_costs.streamed(side)
        assert len(bodies) == len(sent) - 1 == len(args) - 1
        assert [_no_id(b) for b in bodies] == [_no_id(b) for b in sent[:-1]]
    assert len(parser_costs.streamed("on")) < len(parser_costs.streamed("off"))


def _no_id(event: bytes) -> bytes:
    return re.sub(rb'"id":"call_[0-9a-f]+"', b'"id":"call"', event)
