"""An upstream's own reading of its model's output: vLLM and SGLang, started with a
reasoning parser or a tool-call parser, send a chat delta's reasoning (`reasoning`, vLLM's
current name, or `reasoning_content`) and its `tool_calls` apart from its `content`.

The gateway takes them as they are (it does not parse an upstream's text twice), checked
for shape only: an entry that is not a call delta is dropped, as an upstream's word is
never trusted further than it must be. The meter counts them as output text
(gateway.serving.metering).
"""

from __future__ import annotations

from typing import Any


def upstream_parse(choice: Any) -> tuple[str, list[dict[str, Any]] | None]:
    """A chat choice's (reasoning, tool-call deltas); ("", None) where it has neither."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    if not isinstance(delta, dict):
        return "", None
    reasoning = delta.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning:
        reasoning = delta.get("reasoning_content")
    reasoning = reasoning if isinstance(reasoning, str) else ""
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return reasoning, None
    return reasoning, [c for c in map(_call_delta, calls) if c is not None] or None


def _call_delta(call: Any) -> dict[str, Any] | None:
    """One tool-call delta in OpenAI's shape (index, id and name on its first, arguments
    text), or None."""
    if not isinstance(call, dict):
        return None
    index, fn = call.get("index", 0), call.get("function")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1024:
        return None
    fn = fn if isinstance(fn, dict) else {}
    name, arguments, call_id = fn.get("name"), fn.get("arguments"), call.get("id")
    if not isinstance(arguments, str):  # some send the arguments as an object
        arguments = "" if arguments is None else None
    if arguments is None or not all(v is None or isinstance(v, str) for v in (name, call_id)):
        return None
    out: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id or name:
        out["id"], out["function"]["name"] = call_id, name
    return out
