"""kvgate's PyTorch engine: paged KV cache, continuous batching, prefix caching."""

from backend_gpu.async_engine import AsyncLLM, EngineDeadError
from backend_gpu.engine import LLM, LLMEngine
from backend_gpu.outputs import EngineStats, PromptTooLongError, RequestOutput
from backend_gpu.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
]
