"""llama.cpp backend: GGUF models served with continuous batching over parallel sequences."""

from backend_local.config import EngineConfig
from backend_local.engine import LocalEngine
from backend_local.errors import DecodeError, ModelLoadError
from backend_local.requests import RequestOutput
from backend_local.sampling import TokenLogprob
from backend_local.stats import EngineStats
from engine_api.errors import EngineDeadError, PromptTooLongError
from engine_api.sampling import SamplingParams

__all__ = [
    "DecodeError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LocalEngine",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
