"""The bodies of Ollama's model-management routes that act on a models directory:
/api/copy, /api/create (from a model the directory has) and /api/delete. Strict like
every body: /api/create's fields that build a model from blobs, a Modelfile or a
quantization (files, adapters, template, system, parameters, quantize, ...) are a 400
naming them, as kvgate copies a file and makes no new model of one.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.fields import Name
from gateway.schemas.ollama import served_name


class _Named(_Body):
    """A body naming one model as `model`, or as the older `name`."""

    model: Name | None = None
    name: Name | None = None

    @model_validator(mode="after")
    def _one(self) -> _Named:
        if (self.model is None) == (self.name is None):
            raise ValueError("send model (or the older name), exactly one")
        return self

    @property
    def served(self) -> str:
        return served_name(self.model or self.name or "")


class OllamaDeleteRequest(_Named):
    pass


class OllamaCreateRequest(_Named):
    from_: Name = Field(alias="from")  # kvgate creates only a copy of a model it has
    stream: bool = True

    @property
    def source(self) -> str:
        return served_name(self.from_)


class OllamaCopyRequest(_Body):
    source: Name
    destination: Name
