"""What every output parser hands the APIs: reasoning, content and tool-call deltas.

A model family writes its reasoning and tool calls as text markers (`<think>`, `<tool_call>`,
`[TOOL_CALLS]`, harmony channels...). Parsers read that text, never tokens, so a delta of many
tokens (speculative decoding, a slow client) or a marker split across deltas parses the same as
the whole text; the only text a parser holds back is what could still become a marker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call: its id and name come once, its arguments in fragments.
    Not frozen, though nothing changes one: a frozen dataclass's __init__ costs three
    times as much, and a streamed call makes one a token."""

    index: int  # which call of the reply, 0-based
    id: str | None  # set on the call's first delta only ("call_" + random hex)
    name: str | None  # set on the call's first delta only
    arguments: str  # a fragment of the call's JSON arguments text (may be "")


@dataclass(slots=True, init=False)
class ParsedDelta:
    """What a piece of generated text turned out to be. Its own `__init__`, and the hot
    paths call it positionally: a parser makes one a token, and a dataclass's with a
    default factory, called by keyword, costs about 1.7x as much."""

    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]

    def __init__(
        self,
        reasoning: str = "",
        content: str = "",
        tool_calls: list[ToolCallDelta] | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.content = content
        self.tool_calls = [] if tool_calls is None else tool_calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        """Append `other` to this delta (the calls as they came; `merged` joins them per index)."""
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class OutputParser:
    """One per choice: text in (split anywhere), deltas out.

    `in_reasoning` is True while the text being fed is reasoning, so a caller can count
    reasoning tokens as they arrive.
    """

    in_reasoning: bool = False
    reasons = False  # whether it reads reasoning at all

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """Flush held-back text; a marker that never completed is content."""
        raise NotImplementedError

    def feed_final(self, text: str) -> ParsedDelta:
        """`feed` the rest of the text and `finish`, as one delta: a whole answer's parse.
        The parsers override it to pass their states once, where feed then finish
        passes them twice (docs/PERF.md, issue 48)."""
        out = self.feed(text)
        out.extend(self.finish())
        return out

    def reasoning_end(self) -> int | None:
        """How many characters of the text fed so far the reasoning spans, its markers
        included (0: none). A whole answer parsed at once counts its reasoning tokens
        from it. None where the reasoning is not one span at the start (harmony's
        channels): such a parser is fed chunk by chunk."""
        return 0


def merge_calls(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Tool call deltas joined into one per index (id and name from the first, arguments summed)."""
    joined: dict[int, ToolCallDelta] = {}
    for c in calls:
        prev = joined.get(c.index)
        if prev is None:
            joined[c.index] = c
        else:
            joined[c.index] = ToolCallDelta(
                c.index, prev.id or c.id, prev.name or c.name, prev.arguments + c.arguments
            )
    return [joined[i] for i in sorted(joined)]


def parse_whole(parser: OutputParser, text: str) -> ParsedDelta:
    """Feed all of `text` and finish: one delta, tool call deltas merged per index."""
    out = parser.feed_final(text)
    out.tool_calls = merge_calls(out.tool_calls)
    return out
