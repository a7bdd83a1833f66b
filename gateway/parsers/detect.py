"""Which parsers a model needs, read from its chat template (what its tokenizer config
ships), or from its config where the template says nothing.

A template teaches the model its call format in the prompt and replays past calls in it,
so the format's markers are in the template's text; that is what vLLM's documentation
asks a user to match by hand. Reasoning: a template that reads `enable_thinking` is
Qwen3's hybrid (`qwen3`); one whose generation prompt opens `<think>` (DeepSeek-R1-0528,
QwQ, the Qwen3 *-Thinking-2507 models), or a DeepSeek template that strips `</think>`
from past turns (DeepSeek-R1), starts its output inside the reasoning (`deepseek_r1`);
DeepSeek-V3.1's, whose `thinking` switch is off unless a request turns it on, has none.
"""

from __future__ import annotations

import re

GENERATION_PROMPT = re.compile(r"if\s+add_generation_prompt\s*-?%\}")
THINKING_SWITCH = re.compile(r"\bthinking\s+is\s+defined")
# (marker in the template, tool parser), the first that matches wins
TOOL_MARKERS = (
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<function=", "qwen3_coder"),  # Qwen3-Coder also has <tool_call>: look first
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)


def detect(
    chat_template: str | None, architectures: list[str], model_type: str | None
) -> tuple[str | None, str | None]:
    """(reasoning parser, tool-call parser) for a model, either None where none fits."""
    text = chat_template or ""
    if "<|channel|>" in text or model_type == "gpt_oss" or "GptOssForCausalLM" in architectures:
        return "openai", "openai"
    tools = next((name for marker, name in TOOL_MARKERS if marker in text), None)
    if tools is None and "<|start_header_id|>" in text and '"parameters"' in text:
        tools = "llama3_json"  # Llama 3.2's template asks for the JSON form without the tag
    return _reasoning(text, tools), tools


def _reasoning(text: str, tools: str | None) -> str | None:
    if "</think>" not in text:
        return None
    if "enable_thinking" in text:
        return "qwen3"
    if THINKING_SWITCH.search(text):
        return None  # DeepSeek-V3.1's `thinking`, off unless asked: the output is content
    if tools == "deepseek_v3" or _prompt_opens_think(text):
        return "deepseek_r1"
    return None


def _prompt_opens_think(text: str) -> bool:
    """Whether the generation prompt itself writes `<think>` (not only when thinking is off)."""
    for m in GENERATION_PROMPT.finditer(text):
        end = text.find("endif", m.end())
        segment = text[m.end() : end if end != -1 else None]
        if "<think>" in segment:
            return True
    return False
