"""Two call formats that are neither JSON objects nor XML: `pythonic` (a Python list of
calls, Llama 3.2's and Llama 4's alternative) and `deepseek_v3` (DeepSeek-V3 and R1's
fenced JSON between special markers).

`pythonic`: an output that is `[f(a=1, b="x"), g()]` (optionally inside Llama 4's
`<|python_start|>`/`<|python_end|>`) is its calls; it is read with `ast` (literals only,
nothing evaluated) once the output ends, since only the whole output can say it is
nothing but calls. Anything else is content.

`deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n
```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; the name comes first, so the
arguments stream as written. V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` reads too.
"""

from __future__ import annotations

import ast
import json

from gateway.parsers.calls import ToolParser
from gateway.parsers.text import Trim, is_prefix


class PythonicParser(ToolParser):
    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "start"  # start | calls (held to the end) | content

    def run(self, final: bool) -> None:
        if self.state == "start":
            head = self.buf.lstrip()
            if not final and (not head or is_prefix(head, self.START)):
                return
            self.state = "calls" if head.startswith(("[", self.START)) else "content"
        if self.state == "content":
            self.content(self.buf)
            self.buf = ""
        elif final:
            calls = pythonic_calls(self.buf)
            if calls is None or not all(self.allowed(name) for name, _ in calls):
                self.content(self.buf)
            else:
                for name, args in calls:
                    self.call(name, args)
            self.buf = ""


def pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a `[f(a=1), g()]` text, or None when it is not only that."""
    text = text.strip()
    if text.startswith(PythonicParser.START):
        text = text[len(PythonicParser.START) :].removesuffix(PythonicParser.END).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if len(args) != len(node.keywords):
            return None
        calls.append((node.func.id, arguments))
    return calls


BEGIN_ALL, END_ALL = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE = "```"


class DeepSeekV3Parser(ToolParser):
    OPENERS = "<"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "content"  # content | calls | head | name | fence | args | tail | skip
        self.raw = ""  # the call so far, for when it turns out content
        self.part = ""  # the head or name read so far
        self.trim = Trim()

    def run(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass

    def _content(self, final: bool) -> bool:
        text, marker = self.take((BEGIN_ALL,), final)
        self.content(text)
        if marker is None:
            return False
        self.state = "calls"
        return True

    def _calls(self, final: bool) -> bool:
        """Between calls: the next one begins, or the calls end."""
        _, marker = self.take((BEGIN, END_ALL), final)
        if marker is None:
            return False
        self.state, self.raw = ("head", BEGIN) if marker == BEGIN else ("content", "")
        return True

    def _head(self, final: bool) -> bool:
        text, marker = self.take((SEP, END), final)
        self.raw += text + (marker or "")
        self.part += text
        if marker != SEP:
            return self._not_a_call(marker, final)
        part, self.part = self.part.strip(), ""
        if part == "function":  # V3: the name on the next line
            self.state = "name"
            return True
        return self._open(part, "args")  # V3.1: the name before the separator

    def _name(self, final: bool) -> bool:
        text, marker = self.take(("\n", END), final)
        self.raw += text + (marker or "")
        self.part += text
        if marker != "\n":
            return self._not_a_call(marker, final)
        part, self.part = self.part.strip(), ""
        return self._open(part, "fence")

    def _fence(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not final and (not head or is_prefix(head, FENCE + "json")):
            return False
        if head.startswith(FENCE):
            head = head[len(FENCE) :].removeprefix("json")
        self.buf, self.state = head, "args"
        return True

    def _args(self, final: bool) -> bool:
        text, marker = self.take((FENCE, END), final)
        self.args(self.trim.add(text))
        if marker is None:
            return False
        self.state = "tail" if marker == FENCE else "calls"
        return True

    def _tail(self, final: bool) -> bool:
        _, marker = self.take((END,), final)
        if marker is None:
            return False
        self.state = "calls"
        return True

    def _skip(self, final: bool) -> bool:
        """A call to a function not offered: its text, to its end, is content."""
        text, marker = self.take((END,), final)
        self.raw += text + (marker or "")
        if marker is None and not final:
            return False
        return self._not_a_call(marker or END, final=True)

    def _open(self, name: str, state: str) -> bool:
        if not self.allowed(name):
            self.state = "skip"
            return True
        self.call(name)
        self.state, self.trim, self.raw = state, Trim(), ""
        return True

    def _not_a_call(self, marker: str | None, final: bool) -> bool:
        if marker is None and not final:
            return False
        self.content(self.raw)
        self.state, self.raw, self.part = "calls", "", ""
        return marker is not None
