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
