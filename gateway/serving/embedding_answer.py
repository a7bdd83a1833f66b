"""What the gateway and a `kvgate worker` both do with an embeddings request: refuse
`dimensions` the model cannot give, and write the answer's JSON. Apart from
gateway.serving.embedding (admission, quotas, usage rows) so that a worker, which opens
no database, imports none of it: SQLAlchemy and asyncpg were about 0.3 CPU-s of each
worker's start."""

from __future__ import annotations

from gateway.backends import ModelCard
from gateway.http.errors import ApiError
from gateway.http.util import json_bytes, off_loop_if
from gateway.schemas.embeddings import embedding_body

# An answer of more floats than this (2048 inputs of a few hundred each is megabytes of
# JSON) is built and encoded in a worker thread: on the loop it would stall the others.
LARGE_ANSWER_FLOATS = 1 << 16


async def answer_bytes(
    model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str
) -> bytes:
    """The answer's JSON (the gateway's and a worker's), off the loop when large."""
    large = sum(len(v) for v in vectors) > LARGE_ANSWER_FLOATS
    return await off_loop_if(large, _json, model, vectors, prompt_tokens, encoding_format)


def _json(model: str, vectors: list[list[float]], tokens: int, encoding_format: str) -> bytes:
    body = embedding_body(model, vectors, tokens, encoding_format)
    return json_bytes(body)


def check_dimensions(card: ModelCard, dimensions: int | None) -> None:
    """A 400 for `dimensions` the model cannot give."""
    if dimensions is None:
        return
    size = card.embedding_size
    if not card.truncatable:
        sized = f" of {size} dimensions" if size else ""
        raise ApiError(
            400,
            f"The model `{card.id}` does not support `dimensions`: its vectors{sized} "
            "are not made to be shortened.",
            param="dimensions",
        )
    if size is not None and dimensions > size:
        raise ApiError(
            400,
            f"dimensions ({dimensions}) is more than the {size} of the model `{card.id}`.",
            param="dimensions",
        )
