"""POST /v1/embeddings at the HTTP boundary, in OpenAI's shape: the request body, the
answer's models (for the OpenAPI document) and the answer itself, as floats or as
base64 of little-endian float32 (what OpenAI's SDK asks for by default and decodes).

Kept apart from gateway.schemas.inference: an embedding request shares no field with a
completion's but `model` and `user`, and the gateway and a `kvgate worker` both answer it.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gateway.schemas.base import NO_CONTROL, StrictBody
from gateway.schemas.fields import INT32, IntIn, Name
from gateway.schemas.inference import TokenIds
from gateway.schemas.responses import Body

MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request
Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[TokenIds, Field(min_length=1)]


class EmbeddingRequest(StrictBody):
    """OpenAI's embeddings request: one input or up to 2048, each text or token ids."""

    model: Name
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | Ids
        | Annotated[list[Ids], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    # a Matryoshka-trained model's vectors may be cut to their first `dimensions`
    dimensions: Annotated[int, IntIn(1, INT32)] | None = None
    user: Annotated[str, Field(max_length=200, pattern=NO_CONTROL)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _input_given(cls, data: Any) -> Any:
        # pydantic's own words for these would list every member of the union
        if isinstance(data, dict):
            given = data.get("input")
            if given in ("", []) or (isinstance(given, list) and ("" in given or [] in given)):
                raise ValueError("input must not be empty, nor hold an empty string or list")
            many = isinstance(given, list) and not all(isinstance(x, int) for x in given)
            if many and len(given) > MAX_INPUTS:  # a list of ids is one input, not many
                raise ValueError(
                    f"input holds {len(given)} items; at most {MAX_INPUTS} are allowed"
                )
        return data

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string, or token ids."""
        given: Any = self.input
        if isinstance(given, str):
            return [given]
        if all(isinstance(x, int) for x in given):
            return [given]
        return list(given)

    def texts(self) -> list[str] | None:
        """The inputs as text, where every one is (a third-party upstream takes these)."""
        inputs = self.inputs()
        return inputs if all(isinstance(x, str) for x in inputs) else None  # type: ignore[return-value]


class Embedding(Body):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        description="floats, or with encoding_format base64 their little-endian float32 bytes"
    )


class EmbeddingUsage(Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Body):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def embedding_body(
    model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str
) -> dict[str, Any]:
    """The answer, in the order of the inputs."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
