"""Structured outputs in the llama.cpp engine: llguidance's matcher per request, its
mask applied to the sequence's logits in llama.cpp's own buffer before the request's
sampler chain samples from them.

Why not llama.cpp's grammar sampler (GBNF): the JSON-schema-to-GBNF converter reachable
from Python (llama-cpp-python's llama_grammar) drops number bounds (minimum, maximum)
and ignores what it does not know (an unknown format) where it should refuse it, so the
output would not always validate and a bad schema would not be a 400. With the gpu
engine's library (engine_api.grammar) a schema means the same on both engines. Each
sequence still carries its own constraint: its matcher, in its slot.
"""

from __future__ import annotations

import llguidance
import llguidance.llamacpp
import numpy as np

from backend_local.model import LlamaModel
from engine_api.grammar import GrammarCache


def llama_grammar_cache(model: LlamaModel) -> GrammarCache:
    """Compiled grammars over the model's llama.cpp vocabulary; every end-of-generation
    token ends a grammar's output."""
    return GrammarCache(
        lambda: llguidance.llamacpp.lltokenizer_from_vocab(
            model.vocab, n_vocab=model.n_vocab, eos_token=model.eog_ids
        )
    )


class GrammarMask:
    """One worker's buffer for the mask of the row being sampled."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.bitmask = np.empty((1, -(-n_vocab // 32)), dtype=np.int32)

    def apply(self, logits: np.ndarray, matcher: llguidance.LLMatcher) -> None:
        """Set to -inf the logits `matcher`'s grammar forbids next (in place)."""
        matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        # bit j of word w allows token 32 w + j: the words inverted, then unpacked, give a
        # byte per token that is 1 where it is forbidden
        bits = np.unpackbits(np.invert(self.bitmask).view(np.uint8), bitorder="little")
        np.copyto(logits, np.float32(-np.inf), where=bits[: self.n_vocab].view(bool))
