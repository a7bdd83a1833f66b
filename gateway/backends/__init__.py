"""Backend adapters. `build_backend` turns a config entry into a live adapter.

Adapters are imported lazily so that the gateway starts without torch or
llama.cpp loaded when it does not serve them.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from engine_api.errors import AdapterLoadError, BackendError, BadRequestError, PromptTooLongError
from engine_api.records import (
    EMBED,
    GENERATE,
    AdapterRef,
    BackendStats,
    EmbedRequest,
    EmbedResult,
    GenChunk,
    GenRequest,
    KVEvent,
    ModelCard,
    Progress,
    TokenLogprob,
    Usage,
)
from engine_api.sampling import SamplingParams
from gateway.backends.base import (
    Backend,
    EmbeddingBackend,
    LoraBackend,
    OutputCountingBackend,
    ParsedChunk,
    PrefixCachingBackend,
)
from gateway.backends.remote_text import is_text_bound
from gateway.backends.spec import BackendSpec, replica_count

__all__ = [
    "EMBED",
    "GENERATE",
    "AdapterLoadError",
    "AdapterRef",
    "Backend",
    "BackendError",
    "BackendSpec",
    "BackendStats",
    "BadRequestError",
    "EmbedRequest",
    "EmbedResult",
    "EmbeddingBackend",
    "GenChunk",
    "GenRequest",
    "KVEvent",
    "LoraBackend",
    "ModelCard",
    "OutputCountingBackend",
    "ParsedChunk",
    "PrefixCachingBackend",
    "Progress",
    "PromptTooLongError",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
    "build_backend",
    "build_backends",
    "is_text_bound",
    "replica_count",
]


_ADAPTERS = {
    "fake": "gateway.backends.fake:FakeBackend",
    "gpu": "gateway.backends.gpu:GpuBackend",
    "local": "gateway.backends.local:LocalBackend",
    "remote": "gateway.backends.remote:RemoteBackend",
}


def build_backend(spec: BackendSpec) -> Backend:
    if spec.type not in _ADAPTERS:
        raise ValueError(f"unknown backend type {spec.type!r}; expected one of {sorted(_ADAPTERS)}")
    module_name, cls_name = _ADAPTERS[spec.type].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(spec)


def build_backends(spec: BackendSpec) -> list[Backend]:
    """The entry's replicas: option `replicas = N` gives N adapters of the same model,
    named "<name>-0" .. "<name>-<N-1>" (N = 1 keeps the plain name). A remote entry has
    a replica per upstream URL instead (`options.urls`)."""
    if spec.type == "remote":
        from gateway.backends.remote import build_replicas  # lazily, as build_backend does

        return build_replicas(spec)
    n = replica_count(spec)
    options = {k: v for k, v in spec.options.items() if k != "replicas"}
    if n == 1:
        return [build_backend(replace(spec, options=options))]
    return [
        build_backend(replace(spec, name=f"{spec.name}-{i}", options=options)) for i in range(n)
    ]
