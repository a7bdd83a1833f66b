"""A streamed chat sends a chunk only when there is something to say (issue 48): text a
parser holds back (a marker's start, a call's closing brace) makes no empty delta, as
vLLM sends none; the first chunk (the role) and the last (the finish) always go, and a
held token's logprobs still go. What the stream says adds up to the whole answer, and a
parsed stream's own path in ChoiceOutput says what its general one does."""

from __future__ import annotations

import json
import random

import pytest

from gateway.backends import BackendSpec, GenChunk
from gateway.serving.parsed_output import ChoiceOutput
from gateway.serving.parser_choice import Parsers
from gateway.serving.tool_calls import ToolPlan
from studies import gateway_parsers
from tests.gateway.parser_cases import CASES, GET, WEATHER

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


def _pieces(out: ChoiceOutput, texts: list[str]) -> list[tuple]:
    """What a stream's output says, a chunk at a time, then at its finish (call ids
    left out: they are random)."""
    said = []
    for text in texts:
        piece = out.feed(GenChunk([1], text))
        said.append((piece.reasoning, piece.content, _calls(piece.calls)))
    rest, finish = out.finish("stop")
    return [*said, (rest.reasoning, rest.content, _calls(rest.calls), finish)]


def _calls(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in call.items() if k != "id"} for call in calls]


@pytest.mark.parametrize("case", [c for c in CASES if c.reasoning != "openai"], ids=lambda c: c.id)
@pytest.mark.parametrize("refill", [True, False])
def test_a_parsed_streams_own_path_says_what_the_general_one_does(case, refill):
    """ChoiceOutput's path for a parsed stream (`_parsed`, bound as its `feed`) against
    its general `feed`, fed each case a character at a time and in random splits."""
    names = case.options.get("tool_names", GET)
    plan = ToolPlan("auto" if case.tools else "none", {n: WEATHER.get(n) for n in names})
    plan.thinking = case.options.get("thinking", True)
    parsers = Parsers(case.reasoning, case.tools, "configured")
    rng = random.Random(case.id)
    for texts in (list(case.text), _split(case.text, rng), _split(case.text, rng)):
        own, general = (
            ChoiceOutput(plan, parsers, refill=refill),
            ChoiceOutput(plan, parsers, refill=refill),
        )
        assert own.feed.__name__ == "_parsed"
        del general.feed  # the class's own
        assert _pieces(own, texts) == _pieces(general, texts), texts
        assert own.reasoning_tokens == general.reasoning_tokens


def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
