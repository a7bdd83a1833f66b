"""The errors an engine raises and the gateway maps to HTTP statuses: one hierarchy, so
an adapter passes them through instead of translating one package's errors into another's.

BadRequestError (400) is a ValueError: callers of an engine that catch ValueError for bad
input keep working. BackendError (503) is a RuntimeError, as the engines' own were.
"""

from __future__ import annotations


class BackendError(RuntimeError):
    """The backend cannot serve right now (down, overloaded, crashed): HTTP 503."""


class EngineDeadError(BackendError):
    """The engine's thread has stopped (shut down or crashed); no request can be served."""


class AdapterLoadError(BackendError):
    """A request's LoRA adapter would not load (its files broke or changed after it was
    checked): the request fails, the engine serves on; HTTP 500 `adapter_load_failed`
    (no retry mends the files). Its message, which a client hears, names the adapter
    alone; `reason` (the engine's words, its paths) is the operator's."""

    code = "adapter_load_failed"

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(
            f"The LoRA adapter {adapter!r} could not be loaded; the request was not run. "
            "Its administrator can see why in GET /admin/adapters."
        )
        self.adapter, self.reason = adapter, reason


class BadRequestError(ValueError):
    """The request can never be served as sent (prompt too long, empty...): HTTP 400."""


class LoraDisabledError(BadRequestError):
    """A LoRA adapter for an engine started without enable_lora: its caller knows how LoRA
    is turned on (a flag, a config key) and says so."""


class PromptTooLongError(BadRequestError):
    """The prompt, with the tokens asked for, does not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        super().__init__(
            f"This model's maximum context length is {context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens"
            + (f" and {max_tokens} were requested for the completion" if max_tokens else "")
            + "."
        )
