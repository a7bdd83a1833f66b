"""OpenAI's Responses API answers: the Response object and, for a streamed one, its
semantic events (`response.created` ... `response.completed`), numbered in order.

Apart from the route (gateway.routes.responses_api) because a stream is a small state
machine: which output item is open, which content part, what each has said so far, so
that every `*.done` event and the final Response repeat exactly what the deltas sent.
The chat path's Pieces (gateway.serving.parsed_output) are its input: reasoning opens a
reasoning item, text a message, a tool-call delta with an id a function_call item.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from gateway.serving.job import Job
from gateway.serving.parsed_output import Piece

INCOMPLETE = {"length": "max_output_tokens"}  # finish_reason -> incomplete_details.reason


def item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def usage_body(job: Job, reasoning_tokens: int = 0) -> dict[str, Any]:
    """A finished Job's usage as the Response's: what its usage row says."""
    return {
        "input_tokens": job.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": job.cached_tokens,
            "cache_write_tokens": 0,
            "image_tokens": job.image_tokens,
        },
        "output_tokens": job.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def status_of(finish: str | None) -> str:
    return "incomplete" if finish in INCOMPLETE else "completed"


def response_object(
    rid: str,
    created: int,
    model: str,
    echoed: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    finish: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response: `echoed` is the request's fields it repeats (ResponseCreateRequest.echoed)."""
    reason = INCOMPLETE.get(finish or "") if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": reason} if reason else None,
        "model": model,
        "output": output,
        "usage": usage,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "background": False,
        **echoed,
    }


def message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part]
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning item: the model's reasoning as its content (OpenAI's own models give
    only a summary; open models' reasoning is their text, as vLLM gives it)."""
    return {
        "id": rid,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def call_item(fid: str, call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    """A function_call item from a chat tool call (its id is the item's call_id)."""
    return {
        "id": fid,
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def output_items(
    reasoning: str, content: str | None, calls: list[dict[str, Any]], finish: str | None
) -> list[dict[str, Any]]:
    """A whole answer's output: its reasoning, its text as a message (unless it is only
    calls), then one function_call item per call."""
    status = status_of(finish)
    items = [reasoning_item(item_id("rs"), reasoning, status)] if reasoning else []
    if content or (content is not None and not calls):
        items.append(message_item(item_id("msg"), content, status))
    for call in calls:
        items.append(call_item(item_id("fc"), call, call["function"]["arguments"], status))
    return items


def encode(event: dict[str, Any]) -> bytes:
    """One server-sent event: its type as the event's name, and as `type` in its data."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseEvents:
    """The events of one streamed Response, each numbered (`sequence_number`) as sent."""

    def __init__(self, rid: str, created: int, model: str, echoed: dict[str, Any]) -> None:
        self.rid, self.created, self.model, self.echoed = rid, created, model, echoed
        self.seq = 0
        self.done: list[dict[str, Any]] = []  # the output items closed so far
        self.text: list[str] | None = None  # the open message's text so far
        self.thought: list[str] | None = None  # the open reasoning item's text so far
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.call_args: list[str] = []
        self.open_id = ""
        self.chars = 0  # what the output holds: past LARGE_CALL_CHARS it is encoded off the loop

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return encode(event)

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(
            self.rid, self.created, self.model, self.echoed, status, list(self.done), **fields
        )

    def start(self) -> bytes:
        return self._event("response.created", response=self.response("in_progress")) + self._event(
            "response.in_progress", response=self.response("in_progress")
        )

    def delta(self, piece: Piece) -> bytes:
        """Reasoning, text, then chat tool-call deltas: a delta with an id opens a call."""
        out = [self._reasoning(piece.reasoning)] if piece.reasoning else []
        text, calls = piece.content, piece.calls
        if text:
            if self.text is None:
                out.append(self._open_message())
            self.text.append(text)  # type: ignore[union-attr]
            self.chars += len(text)
            out.append(
                self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])
            )
        for call in calls:
            if "id" in call:
                out.append(self.close("completed"))
                self.open_id, self.call = item_id("fc"), call
                self.call_args = []
                item = call_item(self.open_id, call, "", "in_progress")
                out.append(
                    self._event(
                        "response.output_item.added", output_index=len(self.done), item=item
                    )
                )
            args = call.get("function", {}).get("arguments") or ""
            if args:
                self.call_args.append(args)
                self.chars += len(args)
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self.open_id,
                        output_index=len(self.done),
                        delta=args,
                    )
                )
        return b"".join(out)

    def _reasoning(self, text: str) -> bytes:
        opened = b""
        if self.thought is None:
            opened = self.close("completed")
            self.open_id, self.thought = item_id("rs"), []
            item = reasoning_item(self.open_id, "", "in_progress") | {"content": []}
            index = len(self.done)
            opened += self._event("response.output_item.added", output_index=index, item=item)
        self.thought.append(text)
        self.chars += len(text)
        return opened + self._event("response.reasoning_text.delta", **self._at(), delta=text)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.open_id, "output_index": len(self.done), "content_index": 0}

    def _open_message(self) -> bytes:
        closed = self.close("completed")
        self.open_id, self.text = item_id("msg"), []
        item = {**message_item(self.open_id, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (
            closed
            + self._event("response.output_item.added", output_index=len(self.done), item=item)
            + self._event("response.content_part.added", **self._at(), part=part)
        )

    def close(self, status: str) -> bytes:
        """The open item's `*.done` events, if one is open."""
        at = self._at()
        if self.thought is not None:
            text, self.thought = "".join(self.thought), None
            item = reasoning_item(self.open_id, text, status)
            self.done.append(item)
            return self._event("response.reasoning_text.done", **at, text=text) + self._event(
                "response.output_item.done", output_index=at["output_index"], item=item
            )
        if self.text is not None:
            text, self.text = "".join(self.text), None
            item = message_item(self.open_id, text, status)
            self.done.append(item)
            return (
                self._event("response.output_text.done", **at, text=text, logprobs=[])
                + self._event("response.content_part.done", **at, part=item["content"][0])
                + self._event(
                    "response.output_item.done", output_index=at["output_index"], item=item
                )
            )
        if self.call is not None:
            args, call, self.call = "".join(self.call_args), self.call, None
            item = call_item(self.open_id, call, args, status)
            self.done.append(item)
            index = at["output_index"]
            return self._event(
                "response.function_call_arguments.done",
                item_id=self.open_id,
                output_index=index,
                arguments=args,
            ) + self._event("response.output_item.done", output_index=index, item=item)
        return b""

    def finish(self, finish: str | None, usage: dict[str, Any]) -> bytes:
        """The open item closed, and `response.completed` (or `.incomplete`)."""
        status = status_of(finish)
        out = self.close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=self.response(status, usage=usage, finish=finish))

    def failed(self, code: str, message: str) -> bytes:
        """What was sent so far, and `response.failed` with the error."""
        out = self.close("incomplete")
        error = {"code": code, "message": message}
        return out + self._event("response.failed", response=self.response("failed", error=error))
