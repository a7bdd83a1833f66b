"""Each parser's cases: a model's output as its family writes it, and what it parses to.

Shared by the whole-text tests (test_parsers.py) and the split-anywhere property test
(test_parsers_streaming.py). `calls` are (name, arguments text) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GET = frozenset({"get_weather", "lookup"})
WEATHER = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "at": {"type": "object"},
        },
    }
}


@dataclass
class Case:
    id: str
    reasoning: str | None
    tools: str | None
    text: str
    want_reasoning: str = ""
    want_content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


DS_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>'
)

CASES = [
    # reasoning
    Case(
        "r1-no-open",
        "deepseek_r1",
        None,
        "Let me think.\n</think>\n\nIt is 4.",
        "Let me think.",
        "It is 4.",
    ),
    Case("r1-open", "deepseek_r1", None, "<think>\nHmm.\n</think>\n\n4", "Hmm.", "4"),
    Case(
        "r1-unclosed", "deepseek_r1", None, "Still thinking about <b>", "Still thinking about <b>"
    ),
    Case(
        "qwen3-think",
        "qwen3",
        None,
        "<think>\nWhy? Because.\n</think>\n\nBecause.",
        "Why? Because.",
        "Because.",
    ),
    Case(
        "qwen3-no-think",
        "qwen3",
        None,
        "Just an answer </think> here",
        "",
        "Just an answer </think> here",
    ),
    Case(
        "qwen3-off",
        "qwen3",
        None,
        "<think>x</think>y",
        "",
        "<think>x</think>y",
        options={"thinking": False},
    ),
    Case(
        "think-inside-is-reasoning",
        "qwen3",
        "hermes",
        '<think>I could <tool_call>{"name": "lookup"}</tool_call></think>No.',
        'I could <tool_call>{"name": "lookup"}</tool_call>',
        "No.",
    ),
    # hermes
    Case(
        "hermes-after-reasoning",
        "qwen3",
        "hermes",
        '<think>\nNeed weather.\n</think>\n\nChecking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>',
        "Need weather.",
        "Checking. ",
        [("get_weather", '{"city": "Paris"}'), ("lookup", "{}")],
        {"tool_names": GET},
    ),
    Case(
        "hermes-unknown-name",
        None,
        "hermes",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        options={"tool_names": GET},
    ),
    Case(
        "hermes-bad-json",
        None,
        "hermes",
        "a <tool_call>{oops</tool_call> b",
        "",
        "a <tool_call>{oops</tool_call> b",
    ),
    Case(
        "hermes-unclosed",
        None,
        "hermes",
        'x <tool_call>{"name": "lookup"',
        "",
        'x <tool_call>{"name": "lookup"',
    ),
    Case(
        "hermes-no-tools",
        None,
        "hermes",
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>',
        "",
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>',
        options={"tool_names": frozenset()},
    ),
    Case(
        "hermes-text-after",
        None,
        "hermes",
        '<tool_call>{"name": "lookup", "arguments": {"q": "<b>"}}</tool_call>\n\nDone.',
        "",
        "Done.",
        [("lookup", '{"q": "<b>"}')],
    ),
    Case(
        "hermes-keys-reversed",
        None,
        "hermes",
        '<tool_call>{"arguments": {"q":  1}, "name": "lookup"}</tool_call>',
        calls=[("lookup", '{"q": 1}')],
    ),
    Case(
        "hermes-string-arguments",
        None,
        "hermes",
        '<tool_call>{"name": "lookup", "arguments": "{\\"q\\": 1}"}</tool_call>',
        calls=[("lookup", '{"q": 1}')],
    ),
    Case(
        "hermes-nested",
        None,
        "hermes",
        '<tool_call>\n{"name": "lookup", "arguments": {"q": {"r": [1, {}]}}}  \n</tool_call>',
        calls=[("lookup", '{"q": {"r": [1, {}]}}')],
    ),
    # llama3_json
    Case(
        "llama3-tag",
        None,
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "lookup", "parameters": {"q": "x;y"}}',
        "",
        "",
        [("get_weather", '{"city": "Oslo"}'), ("lookup", '{"q": "x;y"}')],
    ),
    Case(
        "llama3-bare",
        None,
        "llama3_json",
        '{"name": "lookup", "parameters": {}}',
        "",
        "",
        [("lookup", "{}")],
    ),
    Case(
        "llama3-json-content",
        None,
        "llama3_json",
        '{"answer": 42} is the object',
        "",
        '{"answer": 42} is the object',
    ),
    Case(
        "llama3-prose", None, "llama3_json", "The weather {is} fine.", "", "The weather {is} fine."
    ),
    Case(
        "llama3-then-text",
        None,
        "llama3_json",
        '{"name": "lookup", "parameters": {}} and more',
        "",
        "and more",
        [("lookup", "{}")],
    ),
    # mistral
    Case(
        "mistral-array",
        None,
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "lookup", "arguments": {}}]',
        "",
        "Sure. ",
        [("get_weather", '{"city": "Rome"}'), ("lookup", "{}")],
    ),
    Case(
        "mistral-args",
        None,
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]lookup[ARGS]{}',
        "",
        "",
        [("get_weather", '{"city": "Rome"}'), ("lookup", "{}")],
    ),
    Case(
        "mistral-call-id",
        None,
        "mistral",
        '[TOOL_CALLS]lookup[CALL_ID]a1b2c3d4e[ARGS]{"q": 1}',
        "",
        "",
        [("lookup", '{"q": 1}')],
    ),
    Case(
        "mistral-not-a-name",
        None,
        "mistral",
        "[TOOL_CALLS] is how I call tools",
        "",
        "[TOOL_CALLS] is how I call tools",
    ),
    Case(
        "mistral-unknown",
        None,
        "mistral",
        '[TOOL_CALLS]rm[ARGS]{"path": "/"}',
        "",
        '[TOOL_CALLS]rm[ARGS]{"path": "/"}',
        options={"tool_names": GET},
    ),
    # qwen3_coder
    Case(
        "coder-typed",
        None,
        "qwen3_coder",
        'I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=at>\n{"lat": 1.5}\n</parameter>\n</function>\n</tool_call>',
        "",
        "I will check.\n",
        [("get_weather", '{"city": "New York", "days": 3, "metric": true, "at": {"lat": 1.5}}')],
        {"tool_params": WEATHER},
    ),
    Case(
        "coder-untyped",
        None,
        "qwen3_coder",
        "<tool_call>\n<function=lookup>\n<parameter=q>\n12\n</parameter>\n</function>\n</tool_call>",
        "",
        "",
        [("lookup", '{"q": "12"}')],
    ),
    Case(
        "coder-no-params",
        None,
        "qwen3_coder",
        "<tool_call><function=lookup></function></tool_call>",
        "",
        "",
        [("lookup", "{}")],
    ),
    Case(
        "coder-not-function",
        None,
        "qwen3_coder",
        '<tool_call>{"name": "x"}</tool_call>',
        "",
        '<tool_call>{"name": "x"}</tool_call>',
    ),
    Case(
        "coder-unknown",
        None,
        "qwen3_coder",
        "<tool_call><function=rm><parameter=p>/</parameter></function></tool_call>",
        "",
        "<tool_call><function=rm><parameter=p>/</parameter></function></tool_call>",
        options={"tool_names": GET},
    ),
    # pythonic
    Case(
        "pythonic",
        None,
        "pythonic",
        '[get_weather(city="Lima", days=2), lookup()]',
        "",
        "",
        [("get_weather", '{"city": "Lima", "days": 2}'), ("lookup", "{}")],
    ),
    Case(
        "pythonic-llama4",
        None,
        "pythonic",
        "<|python_start|>[lookup(q=[1, None, True])]<|python_end|>",
        "",
        "",
        [("lookup", '{"q": [1, null, true]}')],
    ),
    Case("pythonic-not-calls", None, "pythonic", "[1, 2] are numbers", "", "[1, 2] are numbers"),
    Case(
        "pythonic-no-eval",
        None,
        "pythonic",
        "[lookup(q=__import__('os').getcwd())]",
        "",
        "[lookup(q=__import__('os').getcwd())]",
    ),
    Case("pythonic-prose", None, "pythonic", "No calls here.", "", "No calls here."),
    # deepseek_v3
    Case(
        "deepseek-v3",
        None,
        "deepseek_v3",
        "Let me see.<｜tool▁calls▁begin｜>"
        + DS_CALL
        + "\n"
        + DS_CALL.replace("Paris", "Nice")
        + "<｜tool▁calls▁end｜>",
        "",
        "Let me see.",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Nice"}')],
    ),
    Case(
        "deepseek-v3.1",
        None,
        "deepseek_v3",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{"q": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        "",
        [("lookup", '{"q": 1}')],
    ),
    Case(
        "r1-then-deepseek-call",
        "deepseek_r1",
        "deepseek_v3",
        "Weather needed.\n</think>\n\n<｜tool▁calls▁begin｜>" + DS_CALL + "<｜tool▁calls▁end｜>",
        "Weather needed.",
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    Case(
        "deepseek-unknown",
        None,
        "deepseek_v3",
        "<｜tool▁calls▁begin｜>" + DS_CALL + "<｜tool▁calls▁end｜>",
        "",
        DS_CALL,
        options={"tool_names": frozenset({"lookup"})},
    ),
    # openai (harmony)
    Case(
        "harmony-final",
        "openai",
        "openai",
        "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
        "User asks 2+2.",
        "4",
    ),
    Case(
        "harmony-call",
        "openai",
        "openai",
        '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>',
        "Need weather.",
        "",
        [("get_weather", '{"city": "Tokyo"}')],
        {"tool_names": GET},
    ),
    Case(
        "harmony-recipient-first",
        "openai",
        "openai",
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>',
        "",
        "",
        [("lookup", '{"q": 1}')],
    ),
    Case(
        "harmony-unknown",
        "openai",
        "openai",
        "<|channel|>commentary to=functions.rm <|constrain|>json<|message|>{}<|call|>",
        "",
        "{}",
        options={"tool_names": GET},
    ),
    Case(
        "harmony-builtin",
        "openai",
        "openai",
        "<|channel|>analysis to=python<|message|>print(1)<|call|>",
        "print(1)",
    ),
    Case(
        "harmony-no-tools",
        "openai",
        None,
        "<|channel|>commentary to=functions.lookup<|message|>{}<|call|>",
        "",
        "{}",
    ),
]
