"""Constrained decoding in the engine: each row with a structured output has its logits
masked to the tokens its grammar (engine_api.grammar, llguidance) allows next.

The request's matcher is made at admission (LLMEngine.add_request; AsyncLLM compiles
ahead of it off the engine thread), so a schema that does not compile is a
BadRequestError and nothing else. Masks are computed on the host for the constrained
rows only, in parallel across them, after the step's forward was launched (on CUDA the
device is still busy with it), unpacked to a byte per token there (numpy's unpackbits:
tens of microseconds a row, where torch's bit ops took milliseconds on a CPU), and
applied to those rows' logits alone: constrained and free requests share every batch.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch

from engine_api.grammar import GrammarCache


def hf_grammar_cache(tokenizer, vocab_size: int, eos_token_ids: set[int]) -> GrammarCache:
    """Compiled grammars over a Hugging Face tokenizer, `vocab_size` logits wide."""
    return GrammarCache(
        lambda: llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
    )


class GrammarMasks:
    """Applies the constrained rows' masks to a step's logits (Sampler's part)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.executor: llguidance.LLExecutor | None = None
        self.bitmask = np.empty((0, 0), dtype=np.int32)

    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Set to -inf, in each row with a matcher, the logits its grammar forbids next."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        vocab = logits.shape[1]
        bitmask = self._bitmask(len(rows), vocab)
        if self.executor is None:
            self.executor = llguidance.LLExecutor()
        pairs = [(matchers[row], i) for i, row in enumerate(rows)]
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
        # bit j of word w allows token 32 w + j: the words inverted, then unpacked (numpy
        # does a row in tens of us), give a byte per token that is 1 where it is forbidden
        bits = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=1, bitorder="little")
        forbidden = bits[:, :vocab].view(bool)
        if logits.device.type == "cpu":
            # in numpy, in place: on a busy CPU torch's threads cost more than the work
            host = logits.numpy()
            for i, row in enumerate(rows):
                np.copyto(host[row], np.float32(-np.inf), where=forbidden[i])
            return
        on_device = torch.from_numpy(forbidden).to(self.device, non_blocking=True)
        index = torch.tensor(rows, device=self.device)
        logits[index] = logits[index].masked_fill(on_device, float("-inf"))

    def _bitmask(self, rows: int, vocab: int) -> np.ndarray:
        """The host buffer for `rows` masks, grown when needed."""
        words = -(-vocab // 32)
        if self.bitmask.shape[0] < rows or self.bitmask.shape[1] != words:
            self.bitmask = np.empty((rows, words), dtype=np.int32)
        return self.bitmask[:rows]
