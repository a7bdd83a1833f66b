"""The request bodies of the OpenAPI document (gateway.routes.openapi): the pydantic models
that validate them, whose schemas the document carries, and the examples each carries,
which the examples phase of a fuzzer (tests/gateway/test_fuzz.py) starts from. Apart
from the route table: they are about the models, not the routes; the document's
components carry these models' schemas, and tests/gateway/test_openapi.py holds each to
its examples.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from gateway.schemas import embeddings as e
from gateway.schemas import ollama as o
from gateway.schemas import ollama_manage as om
from gateway.schemas import responses_api as r
from gateway.schemas.adapters import AdapterCreate
from gateway.schemas.admin import (
    AdminPinCreate,
    KeyCreate,
    KeyUpdate,
    PinCreate,
    TenantCreate,
    TenantUpdate,
)
from gateway.schemas.batches import BatchCreate
from gateway.schemas.inference import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.schemas.messages import CountTokensRequest, MessagesRequest

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    r.ResponseCreateRequest,
    PinCreate,
    AdminPinCreate,
    TenantCreate,
    TenantUpdate,
    KeyCreate,
    KeyUpdate,
    TokenizeRequest,
    DetokenizeRequest,
    e.EmbeddingRequest,
    MessagesRequest,
    CountTokensRequest,
    AdapterCreate,
    BatchCreate,
    o.OllamaChatRequest,
    o.OllamaGenerateRequest,
    o.OllamaEmbedRequest,
    o.OllamaEmbeddingsRequest,
    o.OllamaShowRequest,
    om.OllamaCopyRequest,
    om.OllamaCreateRequest,
    om.OllamaDeleteRequest,
)
# request bodies the examples phase of a fuzzer starts from; "model" becomes a served one
_STREAM = {"stream": True, "stream_options": {"include_usage": True}}
_MESSAGES = {"messages": [{"role": "user", "content": "Say hello."}]}
_CHAT = {"model": ""} | _MESSAGES | {"max_tokens": 8}
_TEXT = {"model": "", "prompt": "Once upon a time", "max_tokens": 8}
_RESPONSE = {"model": "", "input": "Say hello.", "max_output_tokens": 8}
_ANTHROPIC = {"model": ""} | _MESSAGES
_PIN = {"name": "support", "text": "You are a helpful support agent.", "model": ""}
EXAMPLES: dict[type[BaseModel], tuple[dict[str, Any], ...]] = {
    ChatCompletionRequest: (_CHAT, _CHAT | _STREAM),
    CompletionRequest: (_TEXT, _TEXT | _STREAM),
    r.ResponseCreateRequest: (_RESPONSE, _RESPONSE | {"stream": True}),
    PinCreate: (_PIN,),
    AdminPinCreate: (_PIN | {"tenant": None, "name": "house-style", "shared": True},),
    TenantCreate: ({"name": "acme", "rpm": 600},),
    TenantUpdate: ({"rpm": 1200},),
    KeyCreate: ({"name": "ci", "scopes": ["inference"]}, {"name": "batch", "rpm": 60}),
    KeyUpdate: ({"rpm": 120, "daily_tokens": None},),
    TokenizeRequest: ({"model": "", "prompt": "Once upon a time"}, {"model": ""} | _MESSAGES),
    DetokenizeRequest: ({"model": "", "tokens": [1, 2, 3]},),
    MessagesRequest: (
        _ANTHROPIC | {"max_tokens": 8},
        _ANTHROPIC | {"max_tokens": 8, "stream": True},
    ),
    CountTokensRequest: (_ANTHROPIC | {"system": "Be brief."},),
    AdapterCreate: ({"name": "sql-lora", "path": "/srv/adapters/sql", "base_model": "base"},),
    BatchCreate: (
        {
            "input_file_id": "file-abc",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ),
    o.OllamaChatRequest: (
        _ANTHROPIC | {"stream": False},
        _ANTHROPIC | {"options": {"num_predict": 8}},
    ),
    o.OllamaGenerateRequest: ({"model": "", "prompt": "Once upon a time", "stream": False},),
    o.OllamaEmbedRequest: ({"model": "", "input": ["first", "second"]},),
    o.OllamaEmbeddingsRequest: ({"model": "", "prompt": "The food was delicious."},),
    o.OllamaShowRequest: ({"model": ""},),
    om.OllamaCopyRequest: ({"source": "smollm2", "destination": "smollm2-copy"},),
    om.OllamaCreateRequest: ({"name": "smollm2-copy", "from": "smollm2", "stream": False},),
    om.OllamaDeleteRequest: ({"name": "smollm2-copy"},),
    e.EmbeddingRequest: (
        {"model": "", "input": "The food was delicious."},
        {"model": "", "input": ["first", "second"], "encoding_format": "base64"},
    ),
}
