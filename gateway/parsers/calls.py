"""What the tool-call parsers share: which names may be called, numbering the calls, and
the content around them.

A block whose function is not among the request's tools is content, as the model wrote
it. Whitespace the models put between and after their calls is dropped; other text
there is content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.parsers.base import OutputParser, ParsedDelta, ToolCallDelta
from gateway.parsers.text import Buffered, new_call_id


class ToolParser(Buffered, OutputParser):
    # the first characters of the markers a parser looks for while in its "content" state
    # (none: its content state is the rest of the reply)
    OPENERS = ""
    state = ""  # "content" where a parser has that state (harmony's has none)

    def __init__(
        self,
        tool_names: frozenset[str] | None,
        tool_params: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.names = tool_names
        self.params = tool_params or {}
        self.calls = 0
        self.after_call = False
        self.out = ParsedDelta()

    def allowed(self, name: object) -> bool:
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def call(self, name: str, arguments: str = "") -> None:
        """Open the next call (its first delta)."""
        self.out.tool_calls.append(ToolCallDelta(self.calls, new_call_id(), name, arguments))
        self.calls += 1
        self.after_call = True

    def args(self, fragment: str) -> None:
        """More of the open call's arguments."""
        if fragment:
            self.out.tool_calls.append(ToolCallDelta(self.calls - 1, None, None, fragment))

    def content(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        self.out.content += text

    def feed(self, text: str) -> ParsedDelta:
        if self.state == "content" and not self.buf and not self.after_call:
            for c in self.OPENERS:
                if c in text:
                    break
            else:  # the common case, a token of plain text: no call can begin in it
                return ParsedDelta("", text)
        self.buf += text
        return self._flush(final=False)

    def finish(self) -> ParsedDelta:
        return self._flush(final=True)

    def feed_final(self, text: str) -> ParsedDelta:
        self.buf += text  # the states run once, final: what feed then finish would give
        return self._flush(final=True)

    def _flush(self, final: bool) -> ParsedDelta:
        self.run(final)
        out, self.out = self.out, ParsedDelta()
        return out

    def run(self, final: bool) -> None:
        """Move the buffer through the parser's states into self.out."""
        raise NotImplementedError


def arguments_text(args: object) -> str | None:
    """A call's arguments as JSON text: an object as compact JSON, a string as it is."""
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


def json_call(obj: object, *arg_keys: str) -> tuple[str, str] | None:
    """(name, arguments text) of a `{"name": ..., <arg_key>: {...}}` object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arg_keys:
        if key in obj:
            text = arguments_text(obj[key])
            return None if text is None else (obj["name"], text)
    return obj["name"], "{}"
