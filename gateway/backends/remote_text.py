"""Serving an upstream whose tokenizer the gateway cannot use (llama-cpp-python's server
renders chat with a template it does not publish; a bare OpenAI-compatible server may
tokenize nothing at all): the prompt travels as text, quotas are reserved from a bound.

The gateway needs token ids before it picks a replica (quota, context check, prefix
hashes). For such an upstream `render` returns a *text-bound prompt*: MARGIN marker ids
followed by the UTF-8 bytes of the prompt (a string) or of the chat as JSON (messages
and tools). Its length bounds the tokens any tokenizer makes of it: every token of a
byte-level BPE or a SentencePiece vocabulary (with byte fallback) covers at least one
byte of the text, so a text has at most as many tokens as bytes; a chat template adds
a few special tokens per turn, fewer than the JSON's bytes for the turn (`{"role":"",
"content":""}` is 25 bytes), and BOS, the generation prompt or a default system prompt
(Llama 3.1's date lines, Qwen's "You are Qwen...": about 25 tokens) fit in the margin.
A chat with the request's chat_template_kwargs (Qwen3's enable_thinking) carries them
too, beside its messages (KWARGS_MARK): the upstream's template takes them, as vLLM's
and SGLang's /v1/chat/completions do. The ids carry the prompt itself, so any replica
of the entry can send it, and the prefix router hashes them as it hashes token ids: by the prompt's leading bytes, as
SGLang's router routes by characters. The upstream's `usage` settles the prompt's
real count (gateway.serving.metering takes it where it is within the bound).

A chat with images for a third-party upstream that takes them (options.vision) is sent
the same way on any such upstream, tokenizer or not, since only its /v1/chat/completions
takes images (remote_vision.py): IMAGES_MARK, the chat as JSON with each image part a
reference to the request's image, then IMAGE_SLOT ids, options.image_tokens of them per
image, which bound what its images count there.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from engine_api.errors import BadRequestError
from engine_api.records import PromptInput
from gateway.backends.base import Backend, OutputCountingBackend
from gateway.backends.capabilities import supports
from gateway.backends.tool_prompt import plain_tool_turns

MARGIN = 64  # marker ids before the bytes: the template's tokens beyond the JSON's bytes
TEXT_MARK = 256  # a string prompt (byte values are 0..255: the marks are not bytes)
CHAT_MARK = 257  # a chat, as JSON
KWARGS_MARK = 258  # a chat and its template's variables: {"messages", "chat_template_kwargs"}
IMAGES_MARK = 259  # a chat with images, as KWARGS_MARK's, then its images' IMAGE_SLOTs
IMAGE_SLOT = 260  # one token an image may count, after an image chat's bytes


def text_bound(
    prompt: PromptInput, tools: list[dict] | None, model: str, kwargs: dict | None = None
) -> list[int]:
    """The text-bound prompt of a string or a chat (with its template's variables
    `kwargs`, if any); a 400 for token ids, which mean nothing without the upstream's
    tokenizer."""
    if isinstance(prompt, str):
        return [TEXT_MARK] * MARGIN + list(prompt.encode())
    if all(isinstance(m, dict) for m in prompt):
        # the gateway's own tool-call format, as for a template without tools: the
        # calls come back as <tool_call> blocks the gateway reads, whatever the server
        messages = plain_tool_turns(list(prompt), tools) if tools else list(prompt)
        carried: Any = messages
        mark = CHAT_MARK
        if kwargs:
            carried, mark = {"messages": messages, "chat_template_kwargs": kwargs}, KWARGS_MARK
        return [mark] * MARGIN + _json_bytes(carried)
    raise BadRequestError(
        f"the upstream of model {model!r} does not tokenize for the gateway, so a prompt "
        "of token ids cannot be sent to it; send text, or set the entry's options.tokenizer"
    )


def image_chat_bound(
    messages: list[dict[str, Any]], tools: list[dict] | None, kwargs: dict | None, slots: int
) -> list[int]:
    """The text-bound prompt of a chat whose image parts are references to the request's
    images (remote_vision.py), with `slots` IMAGE_SLOTs for what its images count."""
    messages = plain_tool_turns(messages, tools) if tools else messages
    carried = {"messages": messages, "chat_template_kwargs": kwargs or {}}
    return [IMAGES_MARK] * MARGIN + _json_bytes(carried) + [IMAGE_SLOT] * slots


def _json_bytes(carried: Any) -> list[int]:
    return list(json.dumps(carried, ensure_ascii=False, separators=(",", ":")).encode())


def is_text_bound(backend: Backend, ids: list[int]) -> bool:
    """Whether `ids`, rendered by `backend`, are a text-bound prompt (their length an
    upper bound, not a count). Only a text-bound backend's are, or a remote upstream's
    image chat: another's real tokens may look the same (64 times token 256; and were a
    worker's real ids 64 times 259, the bound would be their count, billed the same)."""
    return (
        supports(backend, OutputCountingBackend)
        and marked(ids)
        and (backend.text_bound or ids[0] == IMAGES_MARK)
    )


def marked(ids: list[int]) -> bool:
    """Whether `ids` begin with a text-bound prompt's marks."""
    return (
        len(ids) >= MARGIN
        and ids[0] in (TEXT_MARK, CHAT_MARK, KWARGS_MARK, IMAGES_MARK)
        and all(i == ids[0] for i in ids[1:MARGIN])
    )


def carried_prompt(ids: list[int]) -> str | list[dict[str, Any]]:
    """The string or the chat messages a text-bound prompt carries; a 400 for ids made
    to look like one (a client's /detokenize) that carry no valid text."""
    return carried(ids)[0]


def carried(ids: list[int]) -> tuple[str | list[dict[str, Any]], dict[str, Any] | None]:
    """The string or the chat messages a text-bound prompt carries, and the chat
    template's variables it carries with them (None: none); a 400 as carried_prompt."""
    end = len(ids)
    if ids[0] == IMAGES_MARK:  # the bytes end where the slots begin (no byte is a slot)
        with contextlib.suppress(ValueError):
            end = ids.index(IMAGE_SLOT, MARGIN)
    try:
        text = bytes(ids[MARGIN:end]).decode()
        if ids[0] == TEXT_MARK:
            return text, None
        data = json.loads(text)
    except ValueError:  # bytes out of range, invalid UTF-8 or JSON
        raise BadRequestError("the token ids are not a prompt of this model") from None
    if ids[0] == CHAT_MARK:
        return data, None
    messages = data.get("messages") if isinstance(data, dict) else None
    kwargs = data.get("chat_template_kwargs") if isinstance(data, dict) else None
    if not (isinstance(messages, list) and isinstance(kwargs, dict)):
        raise BadRequestError("the token ids are not a prompt of this model")
    return messages, kwargs or None


def chat_body(
    completion: dict[str, Any],
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A /chat/completions body from the /completions body of the same request: the
    sampling fields are the same (vLLM, SGLang, llama.cpp's servers read them on both);
    logprobs are asked for in the chat API's way; the template's variables `kwargs` as
    vLLM's and SGLang's chat_template_kwargs."""
    body = {k: v for k, v in completion.items() if k not in ("prompt", "logprobs")}
    body["messages"] = messages
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if completion.get("logprobs") is not None:
        body |= {"logprobs": True, "top_logprobs": completion["logprobs"]}
    return body
