"""Token ids back to text, for /detokenize: the Backend protocol has no such call, so
each engine's own tokenizer is asked, with the ids checked against its vocabulary first
(llama.cpp reads out of bounds for an id past it)."""

from __future__ import annotations

from collections.abc import Callable

from engine_api.errors import BadRequestError
from gateway.backends import Backend
from gateway.backends.fake import WORD_ID_BASE, WORDS

Decoder = tuple[range, Callable[[list[int]], str]]  # the ids it knows, and how to decode


def detokenize(backend: Backend, kind: str, token_ids: list[int]) -> str:
    known, decode = _DECODERS[kind](backend)
    bad = [t for t in token_ids if t not in known]
    if bad:
        raise BadRequestError(
            f"token ids outside the vocabulary ({known.start}..{known.stop - 1}): {bad[:5]}"
        )
    return decode(token_ids)


def _gpu(backend) -> Decoder:
    tokenizer = backend.engine.tokenizer  # a transformers tokenizer
    return range(len(tokenizer)), tokenizer.decode


def _local(backend) -> Decoder:
    engine = backend.engine
    return range(engine.model.n_vocab), engine.detokenize


def _fake(backend) -> Decoder:
    # the fake's prompt ids are hashes of words, not invertible: only its output decodes
    def decode(ids: list[int]) -> str:
        return " ".join(WORDS[t - WORD_ID_BASE] for t in ids)

    return range(WORD_ID_BASE, WORD_ID_BASE + len(WORDS)), decode


_DECODERS = {"gpu": _gpu, "local": _local, "fake": _fake}
