"""The contract between the gateway and its engines, importable without any engine.

One definition of a generation request, its sampling options, its output and its
errors, used by the gateway, both backends (`backend_gpu`, `backend_local`) and the
wire format to a worker process; plus the helpers both engines share (block hashing,
throughput). Nothing here imports torch, numpy, llama_cpp, aiohttp or a backend, so
every side can import it cheaply and agree on the same records.
"""

from engine_api.errors import BackendError, BadRequestError, EngineDeadError, PromptTooLongError
from engine_api.images import ImageInput, image_input
from engine_api.records import (
    BackendStats,
    GenChunk,
    GenRequest,
    KVEvent,
    Messages,
    ModelCard,
    PromptInput,
    TokenLogprob,
    Usage,
)
from engine_api.sampling import MAX_LOGPROBS, MAX_PENALTY, SamplingParams
from engine_api.structured import StructuredOutput

__all__ = [
    "MAX_LOGPROBS",
    "MAX_PENALTY",
    "BackendError",
    "BackendStats",
    "BadRequestError",
    "EngineDeadError",
    "GenChunk",
    "GenRequest",
    "ImageInput",
    "KVEvent",
    "Messages",
    "ModelCard",
    "PromptInput",
    "PromptTooLongError",
    "SamplingParams",
    "StructuredOutput",
    "TokenLogprob",
    "Usage",
    "image_input",
]
