"""`<think>...</think>` reasoning: DeepSeek-R1's (`deepseek_r1`) and Qwen3's (`qwen3`).

They differ in where the reasoning starts. DeepSeek-R1's template (and QwQ's, and the
Qwen3 *-Thinking-2507 ones) opens `<think>` in the prompt, so the output starts inside
it: everything before `</think>` is reasoning, all of it when `</think>` never comes
(vLLM's reading). Qwen3's hybrid models write `<think>` themselves when thinking is on,
so only an output that opens with `<think>` reasons; one that does not is all content
(thinking was off, or the model chose not to). The content after `</think>` and the
reasoning are stripped of the blank lines the models put around them.

Where the reply may make tool calls, a tool-call parser (`then`) reads the content, so a
call written after the reasoning is a call and `<tool_call>` inside `<think>` is only
reasoning. Once the reasoning is over, `feed` is `then`'s own: a token of the answer or
of a call's arguments passes one parser, not two (docs/PERF.md, issue 48).
"""

from __future__ import annotations

from gateway.parsers.base import OutputParser, ParsedDelta
from gateway.parsers.text import Buffered, Trim, is_prefix

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser(Buffered, OutputParser):
    """Reasoning until `</think>`, content after; `starts_inside`: DeepSeek-R1's reading."""

    reasons = True

    def __init__(self, starts_inside: bool, then: OutputParser | None = None) -> None:
        super().__init__()
        self.starts_inside = starts_inside
        self.then = then  # the tool-call parser that reads the content, if any
        self.state = "start"
        self.in_reasoning = starts_inside
        self.trim = Trim()
        self.lead = True  # content's leading whitespace after `</think>` is dropped
        self.fed = 0  # characters fed
        self.ended = 0  # characters fed up to the end of `</think>`, once it came

    @property
    def done(self) -> bool:
        """Past the reasoning: the rest is content as it comes."""
        return self.state == "content" and not self.lead

    def reasoning_end(self) -> int:
        return self.fed if self.state == "reasoning" else self.ended

    def feed(self, text: str) -> ParsedDelta:
        self.fed += len(text)
        if self.state == "reasoning" and not self.buf and "<" not in text:
            trim = self.trim  # the common case: reasoning goes on
            if trim.started and not trim.ws and not text[-1:].isspace():
                return ParsedDelta(text)  # what trim.add would give, without its call
            return ParsedDelta(trim.add(text))
        if self.state == "content" and not self.lead:
            return ParsedDelta("", text)
        if self.state == "reasoning" and self.holds(text, CLOSE):
            return ParsedDelta()
        self.buf += text
        out = self._run(final=False)
        if self.then is None:
            return out
        if self.done:  # the rest of the reply is the tool-call parser's alone
            self.feed = self.then.feed  # type: ignore[method-assign]
        return self._onward(out, final=False)

    def finish(self) -> ParsedDelta:
        out = self._run(final=True)
        self.in_reasoning = False
        return out if self.then is None else self._onward(out, final=True)

    def feed_final(self, text: str) -> ParsedDelta:
        self.fed += len(text)  # the states run once, final: what feed then finish would give
        self.buf += text
        return self.finish()

    def _onward(self, first: ParsedDelta, final: bool) -> ParsedDelta:
        """The content read so far handed to `then`, after the reasoning."""
        assert self.then is not None
        if final:
            out = self.then.feed_final(first.content)
        elif not first.content:  # reasoning (or held text) only
            return first
        else:
            out = self.then.feed(first.content)
        out.reasoning = first.reasoning
        return out

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "start":
            head = self.buf.lstrip()
            if not final and (not head or is_prefix(head, OPEN)):
                return out
            if head.startswith(OPEN):
                self.buf = head[len(OPEN) :]
                self.state = "reasoning"
            else:
                self.state = "reasoning" if self.starts_inside else "content"
                self.lead = self.starts_inside
            self.in_reasoning = self.state == "reasoning"
        if self.state == "reasoning":
            text, marker = self.take((CLOSE,), final)
            out.reasoning = self.trim.add(text)
            if marker is None:
                return out
            self.state = "content"
            self.in_reasoning = False
            self.ended = self.fed - len(self.buf)
        text, self.buf = self.buf, ""
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        out.content = text
        return out
