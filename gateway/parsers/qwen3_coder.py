"""Qwen3-Coder's XML tool calls (`qwen3_coder`):

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

The name comes first, so a call opens as soon as it is read, and its arguments stream one
parameter at a time (`{"P": value`, `, "Q": value`, `}`). A value is text; it is typed by
the tool's parameters' schema where the request gave one (vLLM's reading: integer,
number, boolean, object and array parsed, anything else a string), else it stays a
string. A `<tool_call>` that does not open with `<function=` is content.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from gateway.parsers.calls import ToolParser
from gateway.parsers.text import is_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


class Qwen3CoderParser(ToolParser):
    OPENERS = "<"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "content"  # content | open | block | params | pname | value | close
        self.raw = ""  # a block that may yet be content
        self.func = ""
        self.pname = ""
        self.value = ""
        self.written = 0  # parameters written into the open call

    def run(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass

    def _content(self, final: bool) -> bool:
        text, marker = self.take((OPEN,), final)
        self.content(text)
        if marker is None:
            return False
        self.state, self.raw = "open", OPEN
        return True

    def _open(self, final: bool) -> bool:
        """After `<tool_call>`: `<function=NAME>` makes it a call, anything else content."""
        head = self.buf.lstrip()
        end = head.find(">") if head.startswith(FUNC) else -1
        if end == -1 and not final and (not head or is_prefix(head, FUNC) or head.startswith(FUNC)):
            return False
        name = head[len(FUNC) : end].strip() if end != -1 else ""
        if end == -1 or not self.allowed(name):
            self.state = "block"
            return True
        self.buf = head[end + 1 :]
        self.func, self.written, self.raw = name, 0, ""
        self.call(name)
        self.state = "params"
        return True

    def _block(self, final: bool) -> bool:
        """A `<tool_call>` block that is not a call: content up to and with its close."""
        text, marker = self.take((CLOSE,), final)
        self.raw += text
        if marker is None and not final:
            return False
        self.content(self.raw + (marker or ""))
        self.raw, self.state = "", "content"
        return True

    def _params(self, final: bool) -> bool:
        _, marker = self.take((PARAM, FUNC_END, CLOSE), final)
        if marker == PARAM:
            self.state, self.pname = "pname", ""
        elif marker is not None or final:
            self._end_call()
            self.state = "close" if marker == FUNC_END else "content"
        return marker is not None

    def _pname(self, final: bool) -> bool:
        text, marker = self.take((">",), final)
        self.pname += text
        if marker is None and not final:
            return False
        self.state, self.value = "value", ""
        return True

    def _value(self, final: bool) -> bool:
        # a value ends at its close, or where the next parameter or the call begins
        text, marker = self.take((PARAM_END, PARAM, FUNC_END, CLOSE), final)
        self.value += text
        if marker is None and not final:
            return False
        self._write_param()
        if marker == PARAM:
            self.state, self.pname = "pname", ""
        elif marker in (FUNC_END, CLOSE) or marker is None:
            self._end_call()
            self.state = "close" if marker == FUNC_END else "content"
        else:
            self.state = "params"
        return marker is not None

    def _close(self, final: bool) -> bool:
        _, marker = self.take((CLOSE,), final)
        if marker is None:
            return False
        self.state = "content"
        return True

    def _write_param(self) -> None:
        name = self.pname.strip()
        value = typed(self.value, self._schema(name))
        sep = "{" if self.written == 0 else ", "
        self.args(
            f"{sep}{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        )
        self.written += 1

    def _end_call(self) -> None:
        self.args("}" if self.written else "{}")

    def _schema(self, param: str) -> dict[str, Any] | None:
        props = (self.params.get(self.func) or {}).get("properties")
        found = props.get(param) if isinstance(props, dict) else None
        return found if isinstance(found, dict) else None


def typed(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as its schema's type; a string without a schema or on failure."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if schema is None:
        return value
    if value.lower() == "null":
        return None
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    try:
        if kind == "string":
            return value
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return (
                int(number)
                if number.is_integer() and "." not in value and "e" not in value.lower()
                else number
            )
        if kind == "boolean":
            low = value.strip().lower()
            return low == "true" if low in ("true", "false") else value
        try:
            return json.loads(value)
        except ValueError:
            return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value
