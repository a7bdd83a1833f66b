"""Response bodies in OpenAI's shapes: whole responses and stream chunks."""

from __future__ import annotations

from typing import Any

from gateway.backends import EMBED, ModelCard, TokenLogprob, Usage


def model_entry(card: ModelCard, created: int) -> dict[str, Any]:
    """A model in /v1/models, the gateway's and a worker's, with vLLM's `max_model_len`
    and kvgate's `task` (generate: chat and completions; embed: /v1/embeddings, with its
    vectors' size and whether `dimensions` cuts them) and `vision` (it takes images)."""
    entry: dict[str, Any] = {
        "id": card.id,
        "object": "model",
        "created": created,
        "owned_by": card.owned_by,
        "max_model_len": card.context_length,
        "task": card.task,
        "vision": card.vision,
    }
    if card.task == EMBED:
        entry |= {"embedding_size": card.embedding_size, "truncatable": card.truncatable}
    return entry


def adapter_entry(name: str, base: ModelCard, created: int) -> dict[str, Any]:
    """A LoRA adapter in /v1/models: its base model's entry under its own id, with vLLM's
    `parent` (the base model's id)."""
    return model_entry(base, created) | {"id": name, "parent": base.id}


def usage_body(u: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """`reasoning_tokens`: a chat's (completion_tokens_details), None for completions."""
    body = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "image_tokens": u.image_tokens,
        },
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top
                ],
            }
            for lp in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob | str], text_offset: int = 0) -> dict[str, Any]:
    """A str is a token with no logprob (an echoed prompt's first): null in its place."""
    tokens = [lp if isinstance(lp, str) else lp.token for lp in items]
    offsets, pos = [], text_offset
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if isinstance(lp, str) else lp.logprob for lp in items],
        "top_logprobs": [None if isinstance(lp, str) else dict(lp.top) for lp in items],
        "text_offset": offsets,
    }


def chat_choice(
    index: int,
    text: str | None,
    finish: str | None,
    lps: list[TokenLogprob] | None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str = "",
):
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:  # vLLM's current name, and the one older clients read
        message["reasoning"] = message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(lps) if lps is not None else None,
        "finish_reason": finish,
    }


def completion_choice(
    index: int, text: str, finish: str | None, lps: list[TokenLogprob | str] | None
):
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(lps) if lps is not None else None,
        "finish_reason": finish,
    }


def response_body(
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    choices: list,
    usage: Usage,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage, reasoning_tokens),
        "system_fingerprint": None,
    }


def chunk_body(
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    finish: str | None,
    lps: list[TokenLogprob | str] | None,
    first: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str = "",
) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(lps) if lps else None,
            "finish_reason": finish,
        }
    else:
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": completion_logprobs(lps) if lps else None,
            "finish_reason": finish,
        }
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    chat: bool,
    request_id: str,
    created: int,
    model: str,
    usage: Usage,
    reasoning_tokens: int | None = None,
):
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage, reasoning_tokens),
    }
