"""Chat messages -> prompt text, through the model's own Jinja template or a built-in one.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox. GGUF files without a template (the default Gemma 3 270M is one) get the turn format
of their architecture from `BUILTIN_TEMPLATES`; every template goes through the same path.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.backends.tool_prompt import plain_tool_turns, template_has_tools, with_parsed_arguments

# Gemma has no system role: a system message becomes the head of the first user turn.
_GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0].role == 'system' %}"
    "{% set system_text = messages[0].content + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system_text = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m.role == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Gemma expects turns to alternate user/assistant, starting with user') }}"
    "{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ system_text if loop.first else '' }}{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": _GEMMA,
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "qwen2": _CHATML,
    "qwen3": _CHATML,
    "llama": _LLAMA3,
}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes HTML characters, which templates for prompts do not want.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _text_content(message: dict) -> dict:
    """A copy of `message` whose content is one string (lists of text parts are joined)."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"each message needs a 'role': {message!r}")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"message content must be a string or a list of parts: {content!r}")
    return {**message, "content": content}


def render_chat(
    messages: list[dict],
    chat_template: str | None,
    architecture: str,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """Render `messages` (and `tools`) with `chat_template`, or the built-in template of
    `architecture`; tools and tool turns go through the template where it has a tools
    section, else as plain turns (gateway.backends.tool_prompt).

    `template_kwargs` are the template's extra variables (vLLM's chat_template_kwargs:
    Qwen3's enable_thinking); they cannot replace the ones this passes.

    Raises ValueError for messages the template rejects, non-text content, or an
    architecture without a built-in template when the model has none.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    source = chat_template or BUILTIN_TEMPLATES.get(architecture)
    if source is None:
        raise ValueError(
            f"the model has no chat template and there is no built-in one for architecture "
            f"{architecture!r} (built-in: {', '.join(sorted(BUILTIN_TEMPLATES))}); "
            "use the completions API or a model file with a chat template"
        )
    messages = [_text_content(m) for m in messages]
    extra = {}
    if template_has_tools(source):
        messages = with_parsed_arguments(messages)
        extra = {"tools": tools} if tools else {}
    elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = plain_tool_turns(messages, tools)
    try:
        variables = {
            "messages": messages,
            "bos_token": bos_token,
            "eos_token": eos_token,
            "add_generation_prompt": add_generation_prompt,
            **extra,
        }
        return _compile(source).render({**(template_kwargs or {}), **variables})
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from exc
