"""The bodies of Ollama's model-management routes that act on a models directory:
/api/copy, /api/create (from a model the directory has) and /api/delete. Strict like
every body: /api/create's fields that build a model from blobs, a Modelfile or a
quantization (files, adapters, template, system, parameters, quantize, ...) are a 400
naming them, as kvgate copies a file and makes no new model of one.
"""

from __future__ import annotations

from pydantic import Field

from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.fields import Name
from gateway.schemas.ollama import NamedModel, served_name


class OllamaDeleteRequest(NamedModel):
    pass


class OllamaCreateRequest(NamedModel):
    from_: Name = Field(alias="from")  # kvgate creates only a copy of a model it has
    stream: bool = True

    @property
    def source(self) -> str:
        return served_name(self.from_)


class OllamaCopyRequest(_Body):
    source: Name
    destination: Name
