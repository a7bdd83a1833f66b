"""What the engine adapters share: option checks, model ids, rendering and decoding, and
the refusal of images by a model that does not take them."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

from engine_api.errors import BadRequestError
from engine_api.records import PromptInput, TokenLogprob
from gateway.backends.default_model import DEFAULT_MODEL_ID
from gateway.backends.spec import BackendSpec

# Tokenizing more characters, or decoding more ids, than this would hold the event loop
# for milliseconds.
LARGE_PROMPT_CHARS = 16_384
LARGE_DECODE_IDS = 4_096


def _prompt_chars(prompt: PromptInput) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(message_text(m)) for m in prompt)  # type: ignore[arg-type]
    return 0  # token ids: nothing to tokenize


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text: its content, or its text parts' joined (images left out)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return str(content)


def has_images(prompt: PromptInput) -> bool:
    """Whether chat messages carry an image part ({"type": "image", "image": ImageInput})."""
    return isinstance(prompt, list) and any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(p.get("type") == "image" for p in m["content"])
        for m in prompt
    )


def refuse_images(model: str, prompt: PromptInput) -> None:
    """BadRequestError for images sent to `model`, which does not take them."""
    if has_images(prompt):
        raise BadRequestError(f"model {model!r} does not take images")


async def render_off_loop(
    render: Callable[[PromptInput], list[int]], prompt: PromptInput
) -> list[int]:
    """`render(prompt)` inline when the prompt is small, in a worker thread when it is
    large, so that one big prompt does not stall every other request."""
    if _prompt_chars(prompt) < LARGE_PROMPT_CHARS:
        return render(prompt)
    return await asyncio.to_thread(render, prompt)


async def decode_off_loop(
    decode: Callable[[list[int]], str], token_ids: list[int], known: range
) -> str:
    """`decode(token_ids)` once every id is checked to be one the tokenizer `known`s
    (llama.cpp reads out of bounds past its vocabulary); in a worker thread when there
    are many."""
    bad = [t for t in token_ids if t not in known]
    if bad:
        raise BadRequestError(
            f"token ids outside the vocabulary ({known.start}..{known.stop - 1}): {bad[:5]}"
        )
    if len(token_ids) < LARGE_DECODE_IDS:
        return decode(token_ids)
    return await asyncio.to_thread(decode, token_ids)


def named_logprob(text: Callable[[int], str], lp: Any) -> TokenLogprob:
    """An engine's logprob of token ids (backend_gpu's Logprob, backend_local's
    TokenLogprob: token_id, logprob, top) as engine_api's, each id as its text."""
    return TokenLogprob(text(lp.token_id), lp.logprob, [(text(t), v) for t, v in lp.top])


def check_options(spec: BackendSpec, allowed: Iterable[str]) -> None:
    unknown = set(spec.options) - set(allowed)
    if unknown:
        raise ValueError(
            f"unknown options for {spec.type} backend {spec.name!r}: {sorted(unknown)}; "
            f"expected some of {sorted(allowed)}"
        )


def served_model_id(spec: BackendSpec) -> str:
    """The id clients ask for: as configured, else the file or directory name."""
    if spec.served_model_name:
        return spec.served_model_name
    if spec.model:
        return pathlib.Path(spec.model.rstrip("/")).stem
    return DEFAULT_MODEL_ID


def check_model(model: str, served: str) -> None:
    if model != served:
        raise BadRequestError(f"model {model!r} is not served here (this serves {served!r})")


def render_prompt(
    prompt: PromptInput,
    encode: Callable[[str, bool], list[int]],
    chat_template: str | None,
    architecture: str,
    bos_token: str,
    eos_token: str,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Text, token ids or chat messages -> token ids. `encode(text, add_bos)` tokenizes;
    chat messages (with `tools`, if any, and the template's extra variables
    `template_kwargs`) go through the model's template first."""
    if isinstance(prompt, str):
        return encode(prompt, True)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not prompt or not all(isinstance(m, dict) for m in prompt):
        raise BadRequestError("the prompt must be a string, token ids, or chat messages")
    # here, not at the top: Jinja (the chat templates) is for the backends that render
    # chats; a gateway of fake backends (most of the suite's starts) renders none
    from gateway.backends.chat_template import render_chat

    try:
        text = render_chat(
            prompt,
            chat_template,
            architecture,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=True,
            tools=tools,
            template_kwargs=template_kwargs,
        )
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc
    # templates usually write the BOS token themselves; do not add a second one
    return encode(text, not (bos_token and text.startswith(bos_token)))
