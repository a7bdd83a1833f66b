"""Tool calls written as JSON objects: `llama3_json` (Llama 3.1 / 3.2) and `mistral`
(`[TOOL_CALLS]`). (Hermes' `<tool_call>` blocks: gateway.parsers.hermes.)

A JSON call is known only once its object closes, so these hand out each call whole at
its close, except Mistral's newer `[TOOL_CALLS]name[ARGS]{...}` form, whose name comes
first and whose arguments then stream as the model writes them.
"""

from __future__ import annotations

import json
import re

from gateway.parsers.calls import ToolParser, json_call
from gateway.parsers.text import Trim, is_prefix

DECODER = json.JSONDecoder()
NOT_NAME = re.compile(r"[^\w.\-\[\]]")  # what cannot be in `name` or `name[CALL_ID]id`


def _decode(text: str, final: bool) -> tuple[object, int] | None:
    """The JSON value `text` opens with and where it ends, once it has closed (tried only
    where a value could have closed)."""
    if not final and "}" not in text and "]" not in text:
        return None
    try:
        return DECODER.raw_decode(text)
    except ValueError:
        return None


class Llama3JsonParser(ToolParser):
    """An output that opens with `{` (or `<|python_tag|>`) is `;`-separated
    `{"name": ..., "parameters": {...}}` calls; from the first thing that is not one, content."""

    TAG = "<|python_tag|>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "start"  # start | calls | content

    def run(self, final: bool) -> None:
        if self.state == "start":
            head = self.buf.lstrip()
            if not final and (not head or is_prefix(head, self.TAG)):
                return
            if head.startswith(self.TAG):
                self.buf, self.state = head[len(self.TAG) :], "calls"
            else:
                self.state = "calls" if head.startswith("{") else "content"
        while self.state == "calls":
            # the space, and after a call the `;`s, before the next call go
            head = self.buf.lstrip(" \t\r\n;" if self.calls else None)
            self.buf = head
            if not head:
                return
            if not head.startswith("{"):
                self.state = "content"
                break
            found = _decode(head, final)
            if found is None:
                if not final:
                    return
                self.state = "content"
                break
            obj, end = found
            call = json_call(obj, "parameters", "arguments")
            if call is None or not self.allowed(call[0]):
                self.state = "content"
                break
            self.call(*call)
            self.buf = head[end:]
        if self.state == "content":
            self.content(self.buf)
            self.buf = ""


class MistralParser(ToolParser):
    """Content, then `[TOOL_CALLS]` and either a JSON array of `{"name", "arguments"}`
    (the v3 tokenizer's form) or `name[ARGS]{...}` repeated after each `[TOOL_CALLS]` (v11
    and later; `name[CALL_ID]id[ARGS]` too)."""

    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    OPENERS = "["

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "content"  # content | marked | array | name | args
        self.raw = ""  # the block so far, for when it turns out content
        self.trim = Trim()

    def run(self, final: bool) -> None:
        while True:
            step = getattr(self, "_" + self.state)(final)
            if not step:
                return

    def _content(self, final: bool) -> bool:
        text, marker = self.take((self.MARK,), final)
        self.content(text)
        if marker is None:
            return False
        self.state, self.raw = "marked", self.MARK
        return True

    def _marked(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            if final:
                self._to_content()
            return final
        self.raw += self.buf[: len(self.buf) - len(head)]
        self.buf = head
        self.state = "array" if head.startswith("[") else "name"
        return True

    def _array(self, final: bool) -> bool:
        found = _decode(self.buf, final)
        if found is None:
            if final:
                self._to_content()
            return final
        items, end = found
        calls = (
            [json_call(i, "arguments", "parameters") for i in items]
            if isinstance(items, list)
            else []
        )
        if not calls or any(c is None or not self.allowed(c[0]) for c in calls):
            self.raw += self.buf[:end]
            self.buf = self.buf[end:]
            self._to_content()
            return True
        for c in calls:
            self.call(*c)
        self.buf = self.buf[end:]
        self.state = "content"
        return True

    def _name(self, final: bool) -> bool:
        text, marker = self.take((self.ARGS,), final)
        bad = NOT_NAME.search(text)
        if bad is not None:  # not a name: the block is content from here
            self.raw += text[: bad.start()]
            self.buf = text[bad.start() :] + (marker or "") + self.buf
            self._to_content()
            return True
        self.raw += text
        if marker is None:
            if final:
                self._to_content()
            return final
        name = self.raw[len(self.MARK) :].split(self.CALL_ID)[0].strip()
        self.raw += marker
        if not self.allowed(name):
            self._to_content()
            return True
        self.call(name)
        self.state, self.trim = "args", Trim()
        return True

    def _args(self, final: bool) -> bool:
        text, marker = self.take((self.MARK,), final)
        self.args(self.trim.add(text))
        if marker is None:
            return False
        self.state, self.raw = "marked", self.MARK
        return True

    def _to_content(self) -> None:
        """The block so far was not a call: it is content, and so is what follows it."""
        raw, self.raw = self.raw, ""
        self.content(raw)
        self.state = "content"
