"""Parsers by vLLM's names, and one parser per choice built from a reasoning parser and a
tool-call parser.

The two run in a line: the reasoning parser splits the text into reasoning and the rest,
and hands the rest to the tool-call parser (gateway.parsers.reasoning's `then`), so a call
written after the reasoning is a call and `<tool_call>` inside `<think>` is only reasoning. gpt-oss's
harmony format (`openai`) carries both in its channels, so it is one parser for both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gateway.parsers.base import OutputParser, ParsedDelta
from gateway.parsers.harmony import HarmonyParser
from gateway.parsers.hermes import HermesParser
from gateway.parsers.json_tools import Llama3JsonParser, MistralParser
from gateway.parsers.other_tools import DeepSeekV3Parser, PythonicParser
from gateway.parsers.qwen3_coder import Qwen3CoderParser
from gateway.parsers.reasoning import ThinkParser

REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3", "openai")
TOOL_PARSERS: tuple[str, ...] = (
    "hermes",
    "llama3_json",
    "mistral",
    "qwen3_coder",
    "pythonic",
    "deepseek_v3",
    "openai",
)
TOOLS: dict[str, Callable[..., OutputParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser,
}


class Passthrough(OutputParser):
    """Everything is content."""

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta("", text)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    def feed_final(self, text: str) -> ParsedDelta:
        return ParsedDelta("", text)


def _check(name: str | None, valid: tuple[str, ...], what: str) -> None:
    if name is not None and name not in valid:
        raise ValueError(f"unknown {what} parser {name!r}; valid: {', '.join(valid)}")


def output_parser(
    reasoning: str | None,
    tools: str | None,
    *,
    thinking: bool = True,
    tool_names: frozenset[str] | None = None,
    tool_params: Mapping[str, Mapping[str, Any]] | None = None,
) -> OutputParser:
    """A parser for one choice. `thinking=False` (the request turned thinking off): no
    reasoning is expected. `tools=None` or an empty `tool_names`: call text is content;
    `tool_names=None`: any name is a call. `tool_params`: each tool's parameters' JSON
    schema by name, which types `qwen3_coder`'s values."""
    _check(reasoning, REASONING_PARSERS, "reasoning")
    _check(tools, TOOL_PARSERS, "tool-call")
    calls = tools is not None and tool_names != frozenset()
    if reasoning == "openai" or tools == "openai":
        # harmony's channels: reasoning and calls come together; calls only where asked
        return HarmonyParser(tool_names if calls else frozenset())
    tail = TOOLS[tools](tool_names, tool_params) if calls else None
    if reasoning is None or not thinking:
        return Passthrough() if tail is None else tail
    # the reasoning parser reads the content itself where no calls are read out of it
    return ThinkParser(starts_inside=reasoning == "deepseek_r1", then=tail)
