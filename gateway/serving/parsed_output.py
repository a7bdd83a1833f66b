"""One chat choice's generated text as every API shows it: reasoning, content and tool
calls, streamed or whole, and the reasoning tokens its usage reports.

Chat completions, Anthropic's Messages and OpenAI's Responses all read a choice through a
ChoiceOutput, so that they agree on what was reasoning, what was a call and when the reply
ends with "tool_calls"; each only reshapes its Pieces. The text is read by the backend's
family parser (gateway.parsers, chosen by gateway.serving.parser_choice) unless the tool
plan fixes its meaning: a named call's text is its arguments (streamed as they come), a
required call's a JSON array of calls (read whole at the end), both constrained by a
grammar. A family whose reasoning is a `<think>` block may write it before the
constrained text (gateway.serving.tool_calls.think_first, which the grammar follows):
its reasoning parser reads it off first, and the rest is the call or the structured
output. A remote upstream that
parsed the output itself (vLLM, SGLang) sends its reasoning and calls apart from the text
(gateway.backends.remote_openai's ParsedChunk): they pass through as they are.

A whole answer (`take`, then `finish`) is parsed once, at its end, on its whole text: a
parser fed the text a chunk at a time does the same work a chunk, which a streamed answer
needs and a whole one does not (docs/PERF.md, issue 48). Only harmony's parser, whose
reasoning is not one span at the start, still reads a whole answer chunk by chunk.

Reasoning tokens are the tokens of the chunks that begin before the reasoning's end (its
closing marker's last character): a chunk that holds the end of reasoning and the start
of the answer counts as reasoning whole, and so does one that holds only part of the
opening marker. They are counted at the end, from the chunks' lengths, so that any split
of the text counts the same; harmony's reasoning, which may come anywhere, is counted
as it is fed instead (the chunks fed while the parser was in reasoning, before or after).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.backends import GenChunk, ParsedChunk
from gateway.parsers import OutputParser, ParsedDelta, ToolCallDelta, output_parser
from gateway.parsers.reasoning import ThinkParser
from gateway.parsers.text import new_call_id
from gateway.serving.job import Job
from gateway.serving.parser_choice import Parsers, parsers_of
from gateway.serving.tool_calls import ToolPlan, think_first, tool_call

# the tool-call format gateway.backends.tool_prompt asks for, where no parser is chosen
DEFAULT_TOOL_PARSER = "hermes"


@dataclass(slots=True, init=False)
class Piece:
    """What a stretch of one choice's output is: reasoning, content, and tool-call deltas
    in OpenAI's `delta.tool_calls` shape (a delta with an `id` opens a call). Its own
    `__init__`: a stream makes one a chunk, and a dataclass's with a default factory,
    called by keyword, costs about 1.5x as much."""

    reasoning: str
    content: str
    calls: list[dict[str, Any]]

    def __init__(
        self, reasoning: str = "", content: str = "", calls: list[dict[str, Any]] | None = None
    ) -> None:
        self.reasoning = reasoning
        self.content = content
        self.calls = [] if calls is None else calls

    def chars(self) -> int:
        """What encoding it costs: past outcome.LARGE_CALL_CHARS it is encoded off the loop
        (a required call's whole array comes as one Piece)."""
        chars = len(self.reasoning) + len(self.content)
        for call in self.calls:
            chars += len(call["function"].get("arguments", ""))
        return chars

    def extend(self, other: Piece) -> Piece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ChoiceOutput:
    """One choice: chunks in, Pieces out; `finish` flushes what the parser held.

    `refill`: the Piece `feed` returns, but for a forced call's, is the output's own,
    refilled by the next `feed`: for a stream that encodes each Piece before it feeds the
    next (choice_outputs'), as a new Piece a chunk costs about 150 ns; a caller that keeps
    its Pieces leaves it off."""

    def __init__(
        self, plan: ToolPlan, parsers: Parsers, whole: bool = False, refill: bool = False
    ) -> None:
        self.plan = plan
        self.parser: OutputParser | None = None
        # a forced call's text is read by the reasoning parser alone, if any (its content
        # is the call); the grammar lets reasoning come first where think_first says so
        self.forced = plan.mode in ("named", "required")
        first = think_first(parsers.reasoning, plan.thinking) if plan.constrained else None
        if self.forced and first is not None:
            self.parser = ThinkParser(starts_inside=first == "open_think")
        if plan.mode in ("none", "auto"):
            reasoning = None if plan.constrained and first is None else parsers.reasoning
            tools = (parsers.tools or DEFAULT_TOOL_PARSER) if plan.mode == "auto" else None
            if reasoning or tools:
                self.parser = output_parser(
                    reasoning,
                    tools,
                    thinking=plan.thinking,
                    tool_names=frozenset(plan.schemas),
                    tool_params=plan.schemas,  # qwen3_coder types its values by them
                )
        self.held: list[str] = []  # required: the JSON array, read at the end
        self.chars = 0  # the text fed: a large one is finished off the event loop
        self.reasoning_tokens = 0
        self.ids: dict[int, str] = {}  # each call's index -> the id it was sent with
        self.dropped: set[int] = set()  # calls past the first without parallel_tool_calls
        # where the reasoning is one span at the start, its tokens are counted once its
        # end is known, from the chunks (harmony's as they come)
        self.spans = self.parser is not None and self.parser.reasoning_end() is not None
        self.counting = self.spans and self.parser is not None and self.parser.reasons
        # the chunks: a whole answer's, read at the end (harmony's parser reads them as
        # they come); a stream's while its reasoning tokens are counted
        self.whole = whole
        self.at_once = whole and (self.parser is None or self.spans)
        self.chunks: list[GenChunk] = []
        self.passed = Piece()  # an upstream's own parse, as it came
        self.own = Piece() if refill else None
        if self.parser is None and plan.mode == "none":
            # no parser and no tools: a chunk's text is its content as it is
            self.feed = self._plain  # type: ignore[method-assign]

    def feed(self, chunk: GenChunk) -> Piece:
        """A streamed chunk's Piece (the output's own where it refills one)."""
        piece = self._text(chunk)
        if type(chunk) is ParsedChunk:  # an upstream's own parse (backends.remote_parsed)
            return self._passed(chunk).extend(piece)
        return piece

    def _plain(self, chunk: GenChunk) -> Piece:
        """`feed` without a parser or tools: the text is the content (the general path
        costs 3 to 4x as much a chunk: docs/PERF.md, issue 48), but for an upstream's
        parsed chunk."""
        if type(chunk) is ParsedChunk:
            return ChoiceOutput.feed(self, chunk)
        text = chunk.text
        self.chars += len(text)
        own = self.own
        if own is None:
            return Piece("", text)
        own.content = text  # its reasoning and calls stay empty: no parser, no tools
        return own

    def take(self, chunk: GenChunk) -> None:
        """A chunk of a whole answer: kept, to be read at `finish`."""
        if type(chunk) is ParsedChunk:
            self.passed.extend(self._passed(chunk))
        if not self.at_once:  # harmony's parser: chunk by chunk all the same
            self.passed.extend(self._text(chunk))
            return
        self.chars += len(chunk.text)
        self.chunks.append(chunk)

    def _text(self, chunk: GenChunk) -> Piece:
        text = chunk.text
        self.chars += len(text)
        parser = self.parser
        if parser is not None:
            if self.counting:
                self.chunks.append(chunk)
                parsed = parser.feed(text)
                if not parser.in_reasoning and parser.reasoning_end():
                    self._count()  # the reasoning is over: no more to count
            elif self.spans:  # no reasoning to count
                parsed = parser.feed(text)
            else:
                was = parser.in_reasoning
                parsed = parser.feed(text)
                if was or parser.in_reasoning:
                    self.reasoning_tokens += len(chunk.token_ids) or (1 if text else 0)
            if parsed.tool_calls:
                calls = self._calls(parsed.tool_calls)
            elif self.forced:
                return self._forced(parsed.reasoning, parsed.content)
            else:
                calls = []
            own = self.own
            if own is None:
                return Piece(parsed.reasoning, parsed.content, calls)
            own.reasoning, own.content, own.calls = parsed.reasoning, parsed.content, calls
            return own
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            self.held.append(text)
            return Piece()
        return Piece(content=text)

    def finish(self, reason: str | None) -> tuple[Piece, str | None]:
        """The rest of the choice, and its finish reason ("tool_calls" for a reply that
        made calls and stopped on its own)."""
        if self.whole:
            return self._finish_whole(reason)
        piece = Piece()
        if self.parser is not None:
            parsed = self.parser.finish()
            if self.counting:
                self._count()
            piece = self._parsed(parsed)
        return self._end(piece, reason)

    def _end(self, piece: Piece, reason: str | None) -> tuple[Piece, str | None]:
        """`piece` with a forced call's end, and the finish reason."""
        if self.plan.mode == "named":
            piece.extend(self._named(""))
        elif self.plan.mode == "required":
            content, calls = self.plan.forced("".join(self.held))
            for i, call in enumerate(calls[: None if self.plan.parallel else 1]):
                self.ids[i] = call["id"]
                piece.calls.append({"index": i, **call})
            piece.content = content or ""
        return piece, "tool_calls" if self.ids and reason == "stop" else reason

    def _count(self) -> None:
        """The reasoning tokens, once the reasoning's end is known."""
        assert self.parser is not None
        end = self.parser.reasoning_end() or 0
        self.reasoning_tokens += _chunk_tokens_before(self.chunks, end)
        self.counting, self.chunks = False, []

    def _finish_whole(self, reason: str | None) -> tuple[Piece, str | None]:
        """A whole answer's text read at once (fed and finished in one pass), then ended
        as a stream ends (what came parsed from upstream first)."""
        self.whole = False
        if not self.at_once:  # harmony's parser read the chunks as they came
            piece, reason = self.finish(reason)
            return self.passed.extend(piece), reason
        chunks, self.chunks = self.chunks, []
        text = "".join([c.text for c in chunks])
        parser = self.parser
        if parser is not None:
            piece = self._parsed(parser.feed_final(text))
            if self.counting:  # counted here, from the chunks
                self.counting = False
                self.reasoning_tokens += _chunk_tokens_before(chunks, parser.reasoning_end() or 0)
        elif self.plan.mode == "required":
            self.held.append(text)
            piece = Piece()
        elif self.plan.mode == "named":
            piece = self._named(text)
        else:
            piece = Piece("", text)
        piece, reason = self._end(piece, reason)
        return self.passed.extend(piece), reason

    def _parsed(self, parsed: ParsedDelta) -> Piece:
        """The parser's delta as a Piece: a forced call's text, or reasoning, content and
        calls."""
        if self.forced:
            return self._forced(parsed.reasoning, parsed.content)
        return self._piece(parsed.reasoning, parsed.content, parsed.tool_calls)

    def _forced(self, reasoning: str, text: str) -> Piece:
        """A forced call's text after its reasoning: a named call's arguments as they
        come (the call opens with the first), a required call's array held."""
        piece = Piece(reasoning)
        if self.plan.mode == "named":
            if text:
                piece.extend(self._named(text))
        else:
            self.held.append(text)
        return piece

    def _named(self, text: str) -> Piece:
        """A named call's arguments as they come; the call opens with the first."""
        if 0 not in self.ids:
            assert self.plan.named is not None
            call = tool_call(self.plan.named, text)
            self.ids[0] = call["id"]
            return Piece(calls=[{"index": 0, **call}])
        return Piece(calls=[{"index": 0, "function": {"arguments": text}}] if text else [])

    def _piece(self, reasoning: str, content: str, deltas: list[ToolCallDelta]) -> Piece:
        return Piece(reasoning, content, self._calls(deltas))

    def _calls(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """The parser's call deltas in OpenAI's shape (an id opens a call), but for the
        calls past the first where parallel_tool_calls is off."""
        calls = []
        ids = self.ids
        for d in deltas:
            index = d.index
            if index in ids:  # more of an open call's arguments: the common delta
                if d.arguments:
                    calls.append({"index": index, "function": {"arguments": d.arguments}})
            elif index in self.dropped or not self._may_call():
                self.dropped.add(index)
            else:
                ids[index] = call_id = d.id or new_call_id()
                calls.append({"index": index, **tool_call(d.name or "", d.arguments, call_id)})
        return calls

    def _may_call(self) -> bool:
        return self.plan.parallel or not self.ids

    def _passed(self, chunk: ParsedChunk) -> Piece:
        """An upstream's parsed chunk (its call deltas checked for shape by
        gateway.backends.remote_parsed)."""
        reasoning = chunk.reasoning or ""
        if reasoning:
            self.reasoning_tokens += len(chunk.token_ids) or 1
        deltas = []
        for call in chunk.tool_calls or []:
            fn, index = call["function"], call["index"]
            first = index not in self.ids
            name = fn.get("name") if first else None
            deltas.append(ToolCallDelta(index, call.get("id"), name, fn["arguments"]))
        return self._piece(reasoning, "", deltas)


def _chunk_tokens_before(chunks: list[GenChunk], end: int) -> int:
    """The tokens of the chunks that begin before character `end` of their text."""
    total = at = 0
    for chunk in chunks:
        if at >= end:
            break
        text = chunk.text
        total += len(chunk.token_ids) or (1 if text else 0)
        at += len(text)
    return total


@dataclass
class Whole:
    """A whole answer's Pieces gathered: its reasoning, content and whole calls."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    arguments: dict[int, list[str]] = field(default_factory=dict)

    def add(self, piece: Piece) -> None:
        if piece.reasoning:
            self.reasoning.append(piece.reasoning)
        if piece.content:
            self.content.append(piece.content)
        for delta in piece.calls:
            index = delta["index"]
            if "id" in delta:
                fn = delta["function"]
                self.calls[index] = {"id": delta["id"], "type": "function", "name": fn["name"]}
            self.arguments.setdefault(index, []).append(delta["function"].get("arguments", ""))

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls, OpenAI-shaped, in the order they were made."""
        return [
            tool_call(c["name"], "".join(self.arguments.get(i, [])), c["id"])
            for i, c in sorted(self.calls.items())
        ]

    def text(self) -> str:
        return "".join(self.content)

    def thought(self) -> str:
        return "".join(self.reasoning)


def choice_outputs(job: Job, whole: bool = False) -> list[ChoiceOutput]:
    """One ChoiceOutput per choice of a chat Job, with its backend's parsers; `whole`: an
    answer sent whole, its chunks given to `take` and read at `finish`; else a stream's,
    which refill their Pieces (every stream encodes a chunk's before the next)."""
    parsers = parsers_of(job.gw, job.backend)
    return [ChoiceOutput(job.tools, parsers, whole, not whole) for _ in range(job.num_choices)]


def reasoning_tokens(outputs: list[ChoiceOutput], completion_tokens: int) -> int:
    """The answer's reasoning tokens, within its billed completion tokens."""
    return min(sum(o.reasoning_tokens for o in outputs), completion_tokens)
