"""Prompt lookup: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens are a good guess when the output copies its context."""

from __future__ import annotations

import numpy as np

from backend_gpu.sampler import Sampler
from backend_gpu.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(
        self, seqs: list[Sequence], ks: list[int], sampler: Sampler
    ) -> tuple[list[list[int]], list[None]]:
        """Per sequence up to k tokens, and no draft distribution (a point mass)."""
        drafts = [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, ks, strict=True)]
        return drafts, [None] * len(seqs)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens; the longest suffix (max_n down to min_n) that occurs
        earlier wins, and of its occurrences the latest."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows starting before the suffix itself; a match at i proposes tokens[i+n:]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
