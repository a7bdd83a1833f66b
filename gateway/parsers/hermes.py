"""Hermes-style tool calls (`hermes`: Qwen2.5, QwQ, Qwen3, Hermes):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them.

A block that opens `{"name": "NAME", "arguments": {` (the order every template asks for)
is a call from there: it opens at once and its arguments stream as the model writes them,
up to the object's last `}` (held back until `</tool_call>` says it was the last). A
block in any other shape (the keys the other way round, arguments as a string) is read
whole at its close; one that is not a call to an offered function is content.
"""

from __future__ import annotations

import json
import re

from gateway.parsers.base import ParsedDelta, ToolCallDelta
from gateway.parsers.calls import ToolParser, json_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# where a block's arguments begin; nothing after it can change whether it matched
HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class HermesParser(ToolParser):
    OPENERS = "<"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "content"  # content | head | args | block
        self.block = ""  # a block not yet known to be a call
        self.tail = ""  # the arguments' text that may be the outer object's close

    def feed(self, text: str) -> ParsedDelta:
        if not self.buf and "<" not in text:  # no `</tool_call>` can begin in it
            state = self.state
            if state == "args":  # the common case inside a call: more of its arguments
                last = text[-1:]
                if self.tail or last == "}" or last.isspace():
                    fragment = self._arguments(text)
                else:  # nothing held and nothing to hold: what _arguments would give
                    fragment = text
                if not fragment:
                    return ParsedDelta()
                delta = ToolCallDelta(self.calls - 1, None, None, fragment)
                return ParsedDelta("", "", [delta])
            if state == "content" and not self.after_call:  # plain text: content
                return ParsedDelta("", text)
            if state == "block" or (state == "head" and "{" not in text):
                # more of a block's head (its arguments open with a `{`) or of a block
                # read whole at its close: kept, as _head and _block would keep it
                self.block += text
                return ParsedDelta()
        elif self.holds(text, OPEN if self.state == "content" else CLOSE):
            return ParsedDelta()
        return super().feed(text)

    def feed_final(self, text: str) -> ParsedDelta:
        if not text and not self.buf and self.state == "content":
            return ParsedDelta()  # nothing held: what the states' final pass would give
        return super().feed_final(text)

    def run(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass

    def _content(self, final: bool) -> bool:
        text, marker = self.take((OPEN,), final)
        self.content(text)
        if marker is None:
            return False
        self.state, self.block = "head", ""
        return True

    def _head(self, final: bool) -> bool:
        """Until the block's arguments begin (a streamed call) or it closes (read whole)."""
        text, marker = self.take((CLOSE,), final)
        self.block += text
        # the head can only have come whole with the `{` that opens the arguments: where
        # the new text has none, the block read so far is not read again
        head = HEAD.match(self.block) if "{" in text else None
        if head is not None:
            name = _name(head.group(1))
            if self.allowed(name):
                self.buf = self.block[head.end() :] + (marker or "") + self.buf
                self.call(name)
                self.state, self.tail = "args", ""
                return True
            self.state = "block"
        if marker is None and not final:
            return False
        return self._close(marker)

    def _block(self, final: bool) -> bool:
        text, marker = self.take((CLOSE,), final)
        self.block += text
        if marker is None and not final:
            return False
        return self._close(marker)

    def _args(self, final: bool) -> bool:
        text, marker = self.take((CLOSE,), final)
        self.args(self._arguments(text))
        if marker is None and not final:
            return False
        self.state = "content"
        return marker is not None

    def _arguments(self, text: str) -> str:
        """What of the arguments can go out: the outer object's close and the space
        around it wait, until more arguments or the block's close say what they were."""
        text = self.tail + text
        kept = text.rstrip()
        cut = len(kept) - 1 if kept.endswith("}") else len(kept)
        self.tail = text[cut:]
        return text[:cut]

    def _close(self, marker: str | None) -> bool:
        """A block read whole: a call, or content as it was written."""
        try:
            found = json_call(json.loads(self.block), "arguments", "parameters")
        except ValueError:
            found = None
        if marker is not None and found is not None and self.allowed(found[0]):
            self.call(*found)
        else:
            self.content(OPEN + self.block + (marker or ""))
        self.state, self.block = "content", ""
        return marker is not None


def _name(quoted: str) -> str:
    """A call's name from its JSON string: as it is written where no escape or control
    character can be in it (json.loads, the other case, costs about 1 us)."""
    if "\\" not in quoted and quoted.isprintable():
        return quoted[1:-1]
    return json.loads(quoted)
