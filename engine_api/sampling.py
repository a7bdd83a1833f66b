"""Per-request sampling settings: one definition, with vLLM's names, for every engine.

The gateway builds it, both engines sample with it and the wire carries it, so a limit
is checked in one place (`validate`) and means the same whichever engine serves. The
gateway's HTTP schema imports the shared limits below; it may be stricter (OpenAI caps
temperature at 2), never looser, so nothing it accepts fails later in an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from engine_api.errors import BadRequestError
from engine_api.structured import StructuredOutput
from engine_api.wire import Record, check_types, show

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_PENALTY = 2  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
# counts and token ids fit 32 bits: llama.cpp takes them as int32, torch as int64
INT32_MAX = 2**31 - 1
# torch seeds a generator with 64 bits (signed or not); llama.cpp keeps the low 32
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_PENALTY_RANGE = f"in [-{MAX_PENALTY}, {MAX_PENALTY}]"
MAX_LOGIT_BIAS = 100  # a bias lies in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias: each costs every step


def check_ends(min_tokens: int, ignore_eos: bool) -> None:
    """A structured output's grammar decides where the output ends: nothing may keep its
    end from stopping it. BadRequestError naming the field that would."""
    for name, value in (("min_tokens", min_tokens), ("ignore_eos", ignore_eos)):
        if value:
            raise BadRequestError(f"{name} cannot be combined with a structured output")


@dataclass
class SamplingParams(Record):
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: the sampled token's logprob and the top n
    # None: off; n: each prompt token's logprob given the tokens before it (the first has
    # none) and the top n there. Every prompt position is computed: no prefix cache hit.
    prompt_logprobs: int | None = None
    # (token id, bias) added to the token's logit before anything else; OpenAI's and
    # vLLM's dict {token id: bias} is taken too. Logprobs stay the model's own.
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    # what the output must match (JSON schema, regex, choice, grammar); None: anything
    structured: StructuredOutput | None = None
    # vLLM's: special tokens (a chat's markers, [TOOL_CALLS], <|python_tag|>, harmony's
    # channels) left out of the text; False keeps them, for the output parsers to read.
    # Stop and end-of-sequence tokens are never text.
    skip_special_tokens: bool = True

    wire_error = BadRequestError

    def __post_init__(self) -> None:
        # vLLM takes one stop string for a list of one; "" would stop at once: it means none
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, list | tuple):
            self.stop = [s for s in self.stop if s != ""]
        if isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = list(self.logit_bias.items())
        if isinstance(self.logit_bias, list | tuple):  # JSON's lists as pairs; validate()
            self.logit_bias = [  # refuses anything else by name
                tuple(p) if isinstance(p, list | tuple) else p for p in self.logit_bias
            ]

    def validate(self) -> None:
        """Raise BadRequestError (a ValueError) naming the first field no engine can
        serve, whether these params came from Python, the gateway or the wire."""
        check_types(self, BadRequestError)
        checks = [
            ("max_tokens", 1 <= self.max_tokens <= INT32_MAX, f"in [1, {INT32_MAX}]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("top_k", -1 <= self.top_k <= INT32_MAX, f"-1 or 0 (off) or in [1, {INT32_MAX}]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", abs(self.presence_penalty) <= MAX_PENALTY, _PENALTY_RANGE),
            ("frequency_penalty", abs(self.frequency_penalty) <= MAX_PENALTY, _PENALTY_RANGE),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"in [0, {MAX_LOGPROBS}]",
            ),
            (
                "seed",
                self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
                f"in [{SEED_MIN}, {SEED_MAX}]",
            ),
            (
                "stop_token_ids",
                all(0 <= t <= INT32_MAX for t in self.stop_token_ids),
                f"token ids in [0, {INT32_MAX}]",
            ),
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS
                and len({t for t, _ in self.logit_bias}) == len(self.logit_bias)
                and all(
                    0 <= t <= INT32_MAX and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias
                ),
                f"at most {MAX_LOGIT_BIAS_TOKENS} distinct token ids in [0, {INT32_MAX}], "
                f"each with a bias in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise BadRequestError(f"{name} must be {rule}, got {show(getattr(self, name))}")
        if self.structured is not None:
            self.structured.validate()
            check_ends(self.min_tokens, self.ignore_eos)

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The params `to_dict` gave, validated; unknown fields are an error."""
        params = super().from_dict(data)
        params.validate()
        return params

    def check_vocab(self, vocab_size: int) -> None:
        """BadRequestError if a biased token is not in a vocabulary of this size (the
        engine's check: only it knows the size)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise BadRequestError(
                f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )
