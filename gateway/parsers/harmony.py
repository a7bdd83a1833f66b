"""gpt-oss's harmony format (`openai`), read from its text: reasoning and calls together.

Each message is a header and a body: `<|channel|>analysis<|message|>...<|end|>` is
reasoning, `<|start|>assistant<|channel|>final<|message|>...<|return|>` is content, and
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` is a
call to NAME whose body (its arguments) streams as written; the recipient may also sit
before the channel (`<|start|>assistant to=functions.NAME<|channel|>commentary`).
Commentary with no recipient (a preamble to calls) is content, as vLLM reads it; a
message to a built-in tool (`to=python`, `to=browser.search`) is the model's own work,
so reasoning; a call to a function the request did not offer is content.

This needs the text with harmony's special tokens in it; the `openai-harmony` package
reads token ids instead, which a text-only parser cannot, so it is not used here.
"""

from __future__ import annotations

import re

from gateway.parsers.calls import ToolParser
from gateway.parsers.text import Trim

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", START)
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


class HarmonyParser(ToolParser):
    reasons = True

    def __init__(self, tool_names: frozenset[str] | None) -> None:
        super().__init__(tool_names)
        self.header = ""
        self.kind: str | None = None  # in a body: reasoning | content | call
        self.trim = Trim()

    @property
    def in_reasoning(self) -> bool:  # type: ignore[override]
        return self.kind == "reasoning"

    def reasoning_end(self) -> None:
        return None  # analysis messages may come anywhere

    def run(self, final: bool) -> None:
        while True:
            if self.kind is None:
                text, marker = self.take((MESSAGE,), final)
                self.header += text
                if marker is None:
                    if final and "<|" not in self.header:
                        self.content(self.header)  # text with no harmony at all
                    return
                self.kind = self._open(self.header)
                self.header = ""
            text, marker = self.take(BODY_ENDS, final)
            self._body(text)
            if marker is None:
                return
            self.kind = None

    def _open(self, header: str) -> str:
        """What the message whose header this is holds; a call opens here."""
        channel = CHANNEL_NAME.search(header)
        recipient = RECIPIENT.search(header)
        if recipient is not None:
            to = recipient.group(1)
            if not to.startswith(FUNCTIONS):
                return "reasoning"
            name = to[len(FUNCTIONS) :]
            if not self.allowed(name):
                return "content"
            self.call(name)
            self.trim = Trim()
            return "call"
        if channel is not None and channel.group(1) == "analysis":
            return "reasoning"
        return "content"

    def _body(self, text: str) -> None:
        if self.kind == "reasoning":
            self.out.reasoning += text
        elif self.kind == "call":
            self.args(self.trim.add(text))
        else:
            self.content(text)
