"""The output parsers (gateway.parsers) on whole outputs, and `detect` on the real chat
templates of each family (tests/gateway/fixtures/chat_templates, from the models'
published tokenizer configs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    detect,
    output_parser,
    parse_whole,
)
from tests.gateway.parser_cases import CASES, Case

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_whole_output(case: Case) -> None:
    got = parse_whole(output_parser(case.reasoning, case.tools, **case.options), case.text)
    assert got.reasoning == case.want_reasoning
    assert got.content == case.want_content
    assert [(c.name, c.arguments) for c in got.tool_calls] == case.calls
    assert [c.index for c in got.tool_calls] == list(range(len(case.calls)))
    for call in got.tool_calls:
        assert call.id is not None and call.id.startswith("call_")
        json.loads(call.arguments)  # every call's arguments are JSON


def test_every_parser_has_cases() -> None:
    assert {c.reasoning for c in CASES} >= set(REASONING_PARSERS)
    assert {c.tools for c in CASES} >= set(TOOL_PARSERS)


@pytest.mark.parametrize(
    ("template", "want"),
    [
        ("deepseek-r1", ("deepseek_r1", "deepseek_v3")),
        ("deepseek-v3.1", (None, "deepseek_v3")),
        ("qwen3", ("qwen3", "hermes")),
        ("qwq", ("deepseek_r1", "hermes")),
        ("qwen2.5", (None, "hermes")),
        ("qwen3-coder", (None, "qwen3_coder")),
        ("llama-3.1", (None, "llama3_json")),
        ("llama-3.2", (None, "llama3_json")),
        ("mistral-nemo", (None, "mistral")),
        ("gpt-oss", ("openai", "openai")),
    ],
)
def test_detect_from_template(template: str, want: tuple[str | None, str | None]) -> None:
    text = (TEMPLATES / f"{template}.jinja").read_text()
    assert detect(text, [], None) == want


def test_detect_without_template() -> None:
    assert detect(None, ["GptOssForCausalLM"], "gpt_oss") == ("openai", "openai")
    assert detect(None, ["LlamaForCausalLM"], "llama") == (None, None)
    assert detect("{{ messages }}", [], None) == (None, None)


def test_unknown_names_are_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="hermes") as err:
        output_parser(None, "hermes2")
    assert "hermes2" in str(err.value)
    with pytest.raises(ValueError, match="deepseek_r1"):
        output_parser("r1", None)


def test_no_parsers_is_content() -> None:
    got = parse_whole(output_parser(None, None), "<think>a</think><tool_call>{}</tool_call>")
    assert (got.reasoning, got.content, got.tool_calls) == (
        "",
        "<think>a</think><tool_call>{}</tool_call>",
        [],
    )


def test_in_reasoning_follows_the_text() -> None:
    p = output_parser("deepseek_r1", "hermes")
    assert p.in_reasoning  # the template opened <think>
    p.feed("step one")
    assert p.in_reasoning
    p.feed(" </think>")
    assert not p.in_reasoning
    q = output_parser("qwen3", "hermes")
    q.feed("<think>")
    assert q.in_reasoning
    h = output_parser("openai", "openai")
    h.feed("<|channel|>analysis<|message|>hm")
    assert h.in_reasoning
    h.feed("<|end|><|start|>assistant<|channel|>final<|message|>4")
    assert not h.in_reasoning


def test_a_call_streams_its_arguments_where_the_format_allows() -> None:
    p = output_parser(None, "qwen3_coder")
    first = p.feed("<tool_call>\n<function=lookup>\n")
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "lookup", "")]
    assert first.tool_calls[0].id
    second = p.feed("<parameter=q>\nx\n</parameter>\n")
    assert [(c.id, c.name, c.arguments) for c in second.tool_calls] == [(None, None, '{"q": "x"')]
    h = output_parser(None, "hermes")
    first = h.feed('<tool_call>\n{"name": "lookup", "arguments": {"q": ')
    assert first.tool_calls[0].name == "lookup" and first.tool_calls[0].id
    assert "".join(c.arguments for c in first.tool_calls) == '{"q":'  # the name came first
    rest = h.feed('"x"}}\n</tool_call>')
    assert [(c.id, c.arguments) for c in rest.tool_calls] == [(None, ' "x"}')]
    d = output_parser(None, "deepseek_v3")
    got = d.feed(
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": '
    )
    assert "".join(c.arguments for c in got.tool_calls) == '{"a":'  # the trailing space waits
