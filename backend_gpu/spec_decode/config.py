"""`speculative_config`, vLLM's keys, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft", "eagle3")
MAX_SPECULATIVE_TOKENS = 16  # a verifying step of 17 rows a sequence is already wide


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: shortest suffix looked up
    prompt_lookup_max: int | None = None  # ngram: longest suffix looked up
    # draft: a model sharing the target's tokenizer; eagle3: an EAGLE-3 head's directory
    model: str | os.PathLike | None = None
    # eagle3: the chain goes on only while the head's probability of all its guesses so
    # far is at least this (dynamic speculation: a verify pays no rows for guesses the
    # head itself doubts); None: always k guesses
    draft_confidence_threshold: float | None = None

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in config:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {key} must be an int >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be 1 to "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        threshold = self.draft_confidence_threshold
        if threshold is not None:
            if self.method != "eagle3":
                raise ValueError("draft_confidence_threshold is for the 'eagle3' method")
            if isinstance(threshold, bool) or not isinstance(threshold, int | float):
                raise ValueError(f"draft_confidence_threshold must be a number, got {threshold!r}")
            if not 0 <= threshold < 1:
                raise ValueError(f"draft_confidence_threshold must be in [0, 1), got {threshold}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative method 'ngram' takes no 'model'")
            # vLLM's defaults: neither given -> 5; one given -> both
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            low, high = low or high or 5, high or low or 5
            if low > high:
                raise ValueError(
                    f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})"
                )
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not isinstance(self.model, str | os.PathLike) or not os.fspath(self.model):
                raise ValueError(
                    f"speculative method {self.method!r} needs 'model': a "
                    + ("draft model path" if self.method == "draft" else "EAGLE-3 head directory")
                )
            object.__setattr__(self, "model", os.fspath(self.model))
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min/max are for the 'ngram' method")
