"""Errors the engine raises; the gateway adapter maps them to HTTP statuses."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model file is missing, not a GGUF file, or llama.cpp cannot load it."""


class PromptTooLongError(ValueError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        super().__init__(
            f"prompt of {prompt_tokens} tokens plus max_tokens={max_tokens} does not fit "
            f"the context of {context_length} tokens per sequence"
        )


class EngineDeadError(RuntimeError):
    """The worker thread has stopped (shut down or crashed); no request can be served."""


class DecodeError(RuntimeError):
    """llama_decode failed for a batch holding this request; the engine keeps serving others."""
