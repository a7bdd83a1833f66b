"""Tools and tool turns in the prompt, for chat templates without a tools section.

A template that speaks of `tools` and `tool_calls` renders them itself (HF's convention:
`tools=` beside `messages`, assistant turns with `tool_calls`, `tool` turns). Others (the
built-in ones, Gemma's among them) get plain turns instead:
- the tools, with how to call one, in a system message (before any system text given);
- an assistant turn's calls as `<tool_call>{"name", "arguments"}</tool_call>` blocks,
  the format gateway.serving.tool_calls reads back;
- each tool result as `<tool_response>...</tool_response>` in a user turn (consecutive
  results in one turn, so that templates that alternate user and assistant accept it).
"""

from __future__ import annotations

import json
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "You can call functions. To call one, reply with only\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
    "</tool_call>\n"
    "Available functions, one JSON object a line:\n"
)


def template_has_tools(source: str) -> bool:
    return "tools" in source and "tool_calls" in source


def plain_tool_turns(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` with tools, calls and results written as text (see the module doc)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([content, *blocks]).strip()})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("from_tool"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "from_tool": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("from_tool", None)
    if tools:
        lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        system = FALLBACK_INSTRUCTIONS + lines
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": system + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    return (
        "<tool_call>\n"
        + json.dumps(
            {"name": fn["name"], "arguments": json_or_text(fn["arguments"])}, ensure_ascii=False
        )
        + "\n</tool_call>"
    )


def json_or_text(arguments: str) -> Any:
    """A call's arguments as JSON where they parse (templates take them as objects)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template with a tools section: calls' arguments as objects."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json_or_text(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
