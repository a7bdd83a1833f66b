"""kvgate's PyTorch engine: paged KV cache, continuous batching, prefix caching.

Used as vLLM is: `from backend_gpu import LLM, SamplingParams` (and `AdapterRef`, a LoRA
adapter to generate under). SamplingParams, AdapterRef and the errors are engine_api's (the contract every engine and the gateway share); the engine's
own names load on first use, so `import backend_gpu.config` does not pull in torch.
"""

import importlib

from engine_api.errors import EngineDeadError, PromptTooLongError
from engine_api.records import AdapterRef
from engine_api.sampling import SamplingParams

_EXPORTS = {
    "LLM": "backend_gpu.llm",
    "LLMEngine": "backend_gpu.engine",
    "AsyncLLM": "backend_gpu.async_engine",
    "EngineStats": "backend_gpu.outputs",
    "RequestOutput": "backend_gpu.outputs",
}
__all__ = [*_EXPORTS, "AdapterRef", "EngineDeadError", "PromptTooLongError", "SamplingParams"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'backend_gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
