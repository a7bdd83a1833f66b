"""kvgate's PyTorch engine: paged KV cache, continuous batching, prefix caching.

The public names load on first use, so torch-free parts (`backend_gpu.block_hash`, which
backend_local shares) import without pulling in torch.
"""

import importlib

_EXPORTS = {
    "LLM": "backend_gpu.engine",
    "LLMEngine": "backend_gpu.engine",
    "AsyncLLM": "backend_gpu.async_engine",
    "EngineDeadError": "backend_gpu.async_engine",
    "EngineStats": "backend_gpu.outputs",
    "PromptTooLongError": "backend_gpu.outputs",
    "RequestOutput": "backend_gpu.outputs",
    "SamplingParams": "backend_gpu.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'backend_gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
