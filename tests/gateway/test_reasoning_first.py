"""Reasoning before a forced answer (issue 48.4): with `tool_choice` "required" or named,
or a `response_format` schema, a family whose reasoning is a `<think>` block (qwen3,
deepseek_r1) may think first. The constraint the engine gets says so (its grammar lets
the block come first, engine_api.grammar), and the choice's output reads the block off
as reasoning: the call or the JSON after it is what the constraint held, whole or
streamed in any split. Where thinking is off, or the family has no such block, the
constraint starts at the first token as before."""

from __future__ import annotations

import json
import random

import pytest

from gateway.backends import GenChunk
from gateway.schemas.inference import ChatCompletionRequest
from gateway.serving.parsed_output import ChoiceOutput, Whole
from gateway.serving.parser_choice import Parsers
from gateway.serving.sampling import structured_output
from gateway.serving.tool_calls import ToolPlan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
QWEN3, R1 = Parsers("qwen3", "hermes", "configured"), Parsers("deepseek_r1", None, "configured")
THOUGHT = "Oslo is in Norway; the tool wants the city."


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    return ChatCompletionRequest.model_validate_json(json.dumps(body | fields))


def read(body: ChatCompletionRequest, parsers: Parsers, text: str, seed: int) -> list[Whole]:
    """The answer read whole and streamed a character a chunk (the reasoning tokens of
    the two agree), and streamed in random cuts."""
    plan, rng = ToolPlan.of(body), random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    splits = [list(text), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]]
    out = ChoiceOutput(plan, parsers, whole=True)
    for i, c in enumerate(text):
        out.take(GenChunk([i], c))
    rest, finish = out.finish("stop")
    whole = Whole()
    whole.add(rest)
    answers, counts = [(whole, finish)], [out.reasoning_tokens]
    for pieces in splits:
        out, streamed = ChoiceOutput(plan, parsers), Whole()
        for p in pieces:
            streamed.add(out.feed(GenChunk([0] * len(p), p)))
        rest, finish = out.finish("stop")
        streamed.add(rest)
        answers.append((streamed, finish))
        counts.append(out.reasoning_tokens)
    assert counts[0] == counts[1], counts
    views = {(w.thought(), w.text(), _calls(w), f) for w, f in answers}
    assert len(views) == 1, views
    return [w for w, _ in answers]


def _calls(whole: Whole) -> str:
    return json.dumps(
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls()]
    )


@pytest.mark.parametrize(
    ("parsers", "fields", "form"),
    [
        (QWEN3, {"tools": [WEATHER], "tool_choice": "required"}, "think"),
        (R1, {"tools": [WEATHER], "tool_choice": NAMED}, "open_think"),
        (QWEN3, {"response_format": FORMAT}, "think"),
        (Parsers("openai", "openai"), {"response_format": FORMAT}, None),  # harmony's channels
        (Parsers(None, "hermes"), {"response_format": FORMAT}, None),
    ],
)
def test_the_constraint_says_which_reasoning_comes_first(parsers, fields, form):
    body = chat(**fields)
    assert structured_output(body, parsers.reasoning).reasoning == form
    off = chat(**fields, chat_template_kwargs={"enable_thinking": False})
    assert structured_output(off, parsers.reasoning).reasoning is None


def test_a_required_call_after_qwen3s_reasoning():
    body = chat(tools=[WEATHER], tool_choice="required")
    text = f'<think>\n{THOUGHT}\n</think>\n\n[{{"name": "get_weather", "parameters": {{"city": "Oslo"}}}}]'
    for seed in range(3):
        whole = read(body, QWEN3, text, seed)[0]
        assert whole.thought() == THOUGHT and whole.text() == ""
        [call] = whole.tool_calls()
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    # the model may skip the block, as the grammar lets it: the array alone is the call
    whole = read(body, QWEN3, '[{"name": "get_weather", "parameters": {}}]', 0)[0]
    assert whole.thought() == "" and whole.tool_calls()[0]["function"]["name"] == "get_weather"


def test_a_named_call_after_deepseek_r1s_reasoning_streams_its_arguments():
    body = chat(tools=[WEATHER], tool_choice=NAMED)
    text = f'{THOUGHT}\n</think>\n\n{{"city": "Oslo"}}'  # its prompt opened <think>
    whole = read(body, R1, text, 1)[0]
    assert whole.thought() == THOUGHT
    [call] = whole.tool_calls()
    assert call["function"]["arguments"] == '{"city": "Oslo"}'
    out = ChoiceOutput(ToolPlan.of(body), R1)
    first = out.feed(GenChunk([1], THOUGHT))
    assert first.reasoning == THOUGHT and first.calls == []  # no call opens in reasoning
    out.feed(GenChunk([2], "</think>\n\n"))
    piece = out.feed(GenChunk([3], '{"city": '))
    assert piece.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": '}


def test_a_structured_answer_after_reasoning_is_the_content():
    body = chat(response_format=FORMAT)
    whole = read(body, QWEN3, f'<think>{THOUGHT}</think>\n\n{{"city": "Oslo"}}', 2)[0]
    assert whole.thought() == THOUGHT and json.loads(whole.text()) == {"city": "Oslo"}


def test_thinking_off_or_no_think_block_reads_the_text_as_the_constraint():
    body = chat(tools=[WEATHER], tool_choice=NAMED, chat_template_kwargs={"enable_thinking": False})
    assert ChoiceOutput(ToolPlan.of(body), QWEN3).parser is None
    whole = read(body, QWEN3, '{"city": "Oslo"}', 0)[0]
    assert (
        whole.thought() == ""
        and whole.tool_calls()[0]["function"]["arguments"] == '{"city": "Oslo"}'
    )
    named = ToolPlan.of(chat(tools=[WEATHER], tool_choice=NAMED))
    assert ChoiceOutput(named, Parsers("openai", "openai")).parser is None
