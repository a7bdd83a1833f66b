"""The errors only llama.cpp raises; the ones every engine shares (PromptTooLongError,
EngineDeadError...) are engine_api's, so the gateway maps them without translating."""

from __future__ import annotations

from engine_api.errors import BackendError


class ModelLoadError(RuntimeError):
    """The model file is missing, not a GGUF file, or llama.cpp cannot load it."""


class DecodeError(BackendError):
    """llama_decode failed for a batch holding this request; the engine keeps serving others."""
