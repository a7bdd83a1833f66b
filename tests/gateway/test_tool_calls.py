"""Tools at the boundary, in the prompt and back out of the reply: the request fields'
checks, the fallback rendering for templates without a tools section, and the calls
and reasoning read from a reply, whole and streamed (gateway.serving.parsed_output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.backends import BackendSpec, GenChunk
from gateway.backends.chat_template import render_chat
from gateway.backends.fake import FakeBackend
from gateway.schemas.inference import ChatCompletionRequest, CompletionRequest
from gateway.serving.parsed_output import ChoiceOutput, Whole
from gateway.serving.parser_choice import NONE as NO_PARSERS
from gateway.serving.parser_choice import Parsers, _choose
from gateway.serving.tool_calls import ToolPlan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "assistant"),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "at most one"),
        ({"guided_choice": []}, "choice must hold"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_json": {"type": "object"}, "min_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, error):
    with pytest.raises(ValidationError, match=error):
        chat(**fields)


def test_schema_depth_and_size_are_bounded():
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValidationError, match="deeper than 32"):
        chat(response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": deep}})
    big = {"enum": ["x" * 1000] * 70}
    with pytest.raises(ValidationError, match="at most 65536"):
        CompletionRequest.model_validate({"model": "m", "prompt": "p", "guided_json": big})


def test_each_field_makes_one_structured_output():
    assert chat(response_format={"type": "text"}).structured() is None
    assert chat(response_format={"type": "json_object"}).structured().json_object
    assert chat(guided_regex="a+").structured().regex == "a+"
    assert chat(structured_outputs={"choice": ["a", "b"]}).structured().choice == ["a", "b"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert json.loads(chat(response_format=fmt).structured().json) == schema
    assert (
        chat(guided_json=json.dumps(schema)).structured() == chat(guided_json=schema).structured()
    )


def test_gemma_without_a_tools_section_gets_the_fallback_turns():
    text = render_chat(HISTORY, None, "gemma3", bos_token="<bos>", tools=[WEATHER])
    assert text.count("<start_of_turn>user") == 2  # the tool result is a user turn
    first_user = text.split("<start_of_turn>user\n")[1]
    assert first_user.startswith("You can call functions.") and '"get_weather"' in first_user
    assert "Be brief." in first_user
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_a_template_with_a_tools_section_renders_them_itself():
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }}{% endfor %}\n"
        "{% endfor %}"
    )
    text = render_chat(HISTORY, template, "llama", tools=[WEATHER])
    assert text.startswith("TOOL get_weather\n")
    assert "CALL Oslo" in text and "tool: -3 C" in text  # arguments given as an object


def replies(plan: ToolPlan, pieces: list[str], parsers: Parsers = NO_PARSERS):
    """The streamed Pieces of `pieces` as one choice reads them, the whole answer, and the
    finish reason."""
    out, whole = ChoiceOutput(plan, parsers), Whole()
    streamed = [out.feed(GenChunk([], p)) for p in pieces]
    rest, finish = out.finish("stop")
    for piece in [*streamed, rest]:
        whole.add(piece)
    return [*streamed, rest], whole, finish


def test_named_and_required_constraints_and_parsing():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = ToolPlan.of(chat(tools=[WEATHER], tool_choice=choice))
    assert json.loads(named.constraint().json) == WEATHER["function"]["parameters"]
    pieces, whole, finish = replies(named, ['{"city":', ' "Lima"}'])
    assert pieces[0].calls[0]["function"]["name"] == "get_weather"  # opens with the first
    assert pieces[1].calls == [{"index": 0, "function": {"arguments": ' "Lima"}'}}]
    assert whole.text() == "" and finish == "tool_calls"
    assert whole.tool_calls()[0]["function"]["arguments"] == '{"city": "Lima"}'
    required = ToolPlan.of(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.constraint().json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    _, whole, finish = replies(required, [text[:9], text[9:]])
    assert json.loads(whole.tool_calls()[0]["function"]["arguments"]) == {"city": "Rome"}
    assert ToolPlan.of(chat(tools=[WEATHER], tool_choice="none")).constraint() is None
    # constrained from the first token where no <think> block may come first
    # (tests/gateway/test_reasoning_first.py: where one may)
    assert ChoiceOutput(named, Parsers(None, "hermes")).parser is None


def test_auto_reads_hermes_calls_where_no_parser_is_chosen():
    plan = ToolPlan.of(chat(tools=[WEATHER]))
    reply = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces, whole, finish = replies(plan, [reply[i : i + 4] for i in range(0, len(reply), 4)])
    assert whole.text().strip() == "Let me check." and finish == "tool_calls"
    [call] = whole.tool_calls()
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert "<" not in "".join(p.content for p in pieces)  # the call's text is not content
    # a name not among the tools is not a call
    _, whole, finish = replies(plan, [reply.replace("get_weather", "rm_rf")])
    assert whole.tool_calls() == [] and finish == "stop"


def test_reasoning_then_a_call_and_thinking_turned_off():
    plan = ToolPlan.of(chat(tools=[WEATHER]))
    qwen3 = Parsers("qwen3", "hermes", "configured")
    reply = '<think>Oslo is cold.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    _, whole, finish = replies(plan, list(reply), qwen3)  # a character a chunk
    assert whole.thought() == "Oslo is cold." and finish == "tool_calls"
    assert whole.tool_calls()[0]["function"]["name"] == "get_weather"
    off = ToolPlan.of(chat(chat_template_kwargs={"enable_thinking": False}))
    _, whole, _ = replies(off, ["Just the answer."], qwen3)
    assert whole.thought() == "" and whole.text() == "Just the answer."


TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


class TemplatedBackend(FakeBackend):
    """A backend with what parser_choice asks of an in-process engine (ChatTemplateBackend)."""

    def __init__(self, template: str) -> None:
        super().__init__(BackendSpec("qwen", "fake"))
        self.template = template

    def chat_template_info(self) -> tuple[str | None, list[str], str | None]:
        return self.template, ["Qwen3ForCausalLM"], "qwen3"

    async def render_chat(self, model, prompt, tools, kwargs) -> list[int]:
        return []


def test_parsers_are_detected_from_the_template_unless_the_entry_names_them():
    qwen3 = TemplatedBackend((TEMPLATES / "qwen3.jinja").read_text())
    assert _choose(None, qwen3) == Parsers("qwen3", "hermes", "detected")
    named = BackendSpec("qwen", "gpu", reasoning_parser="deepseek_r1")
    assert _choose(named, qwen3) == Parsers("deepseek_r1", "hermes", "detected")
    both = BackendSpec("qwen", "gpu", reasoning_parser="qwen3", tool_call_parser="qwen3_coder")
    assert _choose(both, qwen3) == Parsers("qwen3", "qwen3_coder", "configured")
    assert _choose(None, TemplatedBackend("{{ messages }}")) == NO_PARSERS


def test_enable_thinking_reaches_qwen3s_own_template():
    template = (TEMPLATES / "qwen3.jinja").read_text()
    on = render_chat([{"role": "user", "content": "hi"}], template, "qwen3")
    off = render_chat(
        [{"role": "user", "content": "hi"}],
        template,
        "qwen3",
        template_kwargs={"enable_thinking": False, "messages": "not these"},
    )
    assert off == on + "<think>\n\n</think>\n\n"  # the template closes an empty think
