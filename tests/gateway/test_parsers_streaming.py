"""Streaming that cannot break (issue 48.3): every parser, fed any split of each of its
cases (one character at a time, whole, and random cuts), parses to what the whole text
parses to. Speculative decoding and slow clients hand parsers many tokens at once, and
a marker can be cut anywhere; neither may change the answer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.parsers import ParsedDelta, merge_calls, output_parser, parse_whole
from tests.gateway.parser_cases import CASES, Case


def _split(text: str, cuts: list[int]) -> list[str]:
    edges = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def _fed(case: Case, pieces: list[str]) -> ParsedDelta:
    parser = output_parser(case.reasoning, case.tools, **case.options)
    got = ParsedDelta()
    for piece in pieces:
        got.extend(parser.feed(piece))
    got.extend(parser.finish())
    for i in {c.index for c in got.tool_calls}:  # a call's id and name come once, first
        firsts = [c for c in got.tool_calls if c.index == i]
        assert (
            firsts[0].id
            and firsts[0].name
            and all(c.id is None and c.name is None for c in firsts[1:])
        )
    got.tool_calls = merge_calls(got.tool_calls)
    return got


def _view(d: ParsedDelta) -> tuple:
    return d.reasoning, d.content, [(c.index, c.name, c.arguments) for c in d.tool_calls]


def _whole(case: Case) -> tuple:
    return _view(parse_whole(output_parser(case.reasoning, case.tools, **case.options), case.text))


def test_one_character_at_a_time_and_whole() -> None:
    for case in CASES:
        want = _whole(case)
        assert _view(_fed(case, list(case.text))) == want, case.id
        assert _view(_fed(case, [case.text])) == want, case.id
        assert _view(_fed(case, ["", case.text, ""])) == want, case.id


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from(CASES),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40),
)
def test_any_split_parses_as_the_whole(case: Case, cuts: list[int]) -> None:
    assert _view(_fed(case, _split(case.text, cuts))) == _whole(case), case.id


# every marker of every family, pieces of them and of calls: texts made of these reach
# the corners the cases do not (a marker inside another's block, one cut short, calls
# to functions not offered)
SOUP = [
    *("<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "<|python_start|>"),
    *('{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}', ";", " ", "\n"),
    *("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", '[{"name": "f", "arguments": {}}]', "[f(a=1), g()]"),
    *("<function=f>", "<parameter=a>", "</parameter>", "</function>", "12", "f", "x", '"', "\\"),
    *("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", "```json"),
    *("```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|channel|>", "analysis", "final"),
    *("commentary to=functions.f", " to=python", "<|message|>", "<|end|>", "<|start|>", "<|call|>"),
    *("<|return|>", "<|constrain|>json", "<", "[", "]", "{", "}", "think>", "tool"),
]
ONLY_F = frozenset({"f"})
SETUPS = [
    *[(r, None, {}) for r in ("deepseek_r1", "qwen3")],
    *[(None, t, {}) for t in ("hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3")],
    (None, "qwen3_coder", {"tool_params": {"f": {"properties": {"a": {"type": "integer"}}}}}),
    ("openai", "openai", {}),
    ("qwen3", "hermes", {"tool_names": ONLY_F}),
    ("deepseek_r1", "deepseek_v3", {"tool_names": ONLY_F}),
    *[(None, t, {"tool_names": ONLY_F}) for t in ("mistral", "qwen3_coder", "llama3_json")],
    ("openai", "openai", {"tool_names": ONLY_F}),
]


@settings(max_examples=1500, deadline=None)
@given(
    setup=st.sampled_from(SETUPS),
    words=st.lists(st.sampled_from(SOUP), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
)
def test_any_text_any_split(setup: tuple, words: list[str], cuts: list[int]) -> None:
    reasoning, tools, options = setup
    case = Case("soup", reasoning, tools, "".join(words), options=options)
    want = _whole(case)
    assert _view(_fed(case, _split(case.text, cuts))) == want
    assert _view(_fed(case, list(case.text))) == want
