"""The records that cross between the asyncio side and the worker thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend_local.sampling import TokenLogprob
from engine_api.block_hash import KeySpan
from engine_api.images import ImageInput
from engine_api.records import AdapterRef, Progress
from engine_api.sampling import SamplingParams


@dataclass
class RequestOutput:
    """One step of a request. The last one has finish_reason set ("stop", "length", "abort")
    and the usage counts filled in."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # the first output of a request with SamplingParams.prompt_logprobs: one per prompt
    # token, None for the first (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    image_tokens: int = 0  # of prompt_tokens, the images' (placeholder runs)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    # Hands a RequestOutput, or the exception that ended the request, to its caller; safe
    # to call from the worker thread.
    emit: Callable[[RequestOutput | BaseException], None]
    shared_prefix_len: int = 0  # leading prompt tokens that are a published prefix
    arrival: float = field(default_factory=time.monotonic)
    # a structured output's llguidance matcher (backend_local.grammar), made at submission
    grammar: Any = None
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under; None: the base model
    # where its caller reads how much of the prompt is in cells (reused ones as cached)
    progress: Progress | None = None
    # its images (backend_local.vision) and their placeholder runs in `prompt`, each
    # keyed by its image's digest (engine_api.block_hash.image_key_spans), in order
    images: list[ImageInput] = field(default_factory=list)
    spans: list[KeySpan] = field(default_factory=list)
