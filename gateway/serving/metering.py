"""What the gateway itself counts of each choice's output as it goes to the client, and
the limits it holds every backend to, whatever the backend claims.

Billing must not rest on a backend's word: a remote upstream's usage is a claim (it may
be buggy or hostile), its chunks carry text but no token ids, and a client that leaves
mid-stream ends the request before any usage arrives. So every chunk on its way to the
client passes one ChoiceMeter, which

- counts it: the token ids where the backend sends them, else at least one token per
  piece of text (every streamed event carries a token) or per logprob entry, and keeps
  that text for a tokenizer count when the request ends;
- holds it to what the client was promised: output stops at max_tokens (and at a bound
  on its text, so memory per request is bounded too), logprobs are cut to the number
  asked for, prompt logprobs to the prompt;
- takes the backend's usage on the last chunk only where it is consistent with what was
  delivered (what was counted <= completion <= max_tokens, 0 <= cached, images <= prompt); the
  prompt is the gateway's own count, or, where that is only a bound (a text-bound prompt,
  gateway/backends/remote_text.py), the claim within it;
- carries the Progress the backend fills with how much of the prompt it computed: what a
  choice cut before its last chunk (before its first, during prefill) pays for its prompt.

`Job.finish` settles each choice to `ChoiceMeter.billed`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.backends import (
    Backend,
    GenChunk,
    GenRequest,
    ParsedChunk,
    Progress,
    TokenLogprob,
    Usage,
    is_text_bound,
)

log = logging.getLogger("kvgate")

# Text a choice may carry per token of max_tokens: far above any vocabulary's longest
# token (most are under 16 characters), so it only ever stops a misbehaving upstream.
MAX_CHARS_PER_TOKEN = 256
# A claim of fewer tokens than this many characters each (text averages about 4) is
# checked against a tokenizer count even where only the upstream itself can count.
PLAUSIBLE_CHARS_PER_TOKEN = 16
COUNTERS = ("engine", "gateway")  # who counted a usage


@dataclass
class ChoiceMeter:
    """One choice's output as the gateway delivered it."""

    request_id: str
    max_tokens: int
    top_logprobs: int | None  # None: no logprobs were asked for
    prompt_tokens: int
    ids: int = 0  # token ids delivered
    pieces: int = 0  # tokens counted from chunks without ids (at least one a piece)
    chars: int = 0  # text and logprob tokens delivered
    text: list[str] = field(default_factory=list)  # the text of chunks without ids
    claim: Usage | None = None  # the backend's usage, once taken
    refused: str | None = None  # why the backend's usage was not taken
    finished: bool = False  # the last chunk went out (a finish reason, or a cut)
    # the prompt's length is an upper bound, not a count (a text-bound prompt for an
    # upstream the gateway cannot tokenize for): the backend's claim settles it, else
    # the upstream tokenizer's count of it where one was made
    prompt_bound: bool = False
    prompt_counted: int | None = None
    # how much of the prompt the backend computed (it fills this): a choice cut short
    # bills its prompt by it (Job.finish)
    progress: Progress = field(default_factory=Progress)

    @classmethod
    def of(cls, req: GenRequest, backend: Backend) -> ChoiceMeter:
        sp = req.sampling
        ids = req.prompt_token_ids
        bound = is_text_bound(backend, ids)
        return cls(req.request_id, sp.max_tokens, sp.logprobs, len(ids), prompt_bound=bound)

    @property
    def prompt(self) -> int:
        """The prompt's tokens as billed: the gateway's count, or the backend's claim
        where the gateway's is only a bound and the claim is within it."""
        if self.claim is not None:
            return self.claim.prompt_tokens
        if self.prompt_bound and self.prompt_counted is not None:
            return min(max(self.prompt_counted, 1), self.prompt_tokens)
        return self.prompt_tokens

    @property
    def delivered(self) -> int:
        """Tokens delivered, as far as the gateway can count them while streaming."""
        return self.ids + self.pieces

    @property
    def count(self) -> int:
        """The running count: the backend's claim once taken, else what was delivered."""
        return self.claim.completion_tokens if self.claim is not None else self.delivered

    @property
    def cached(self) -> int:
        """Its prompt's cached tokens: the backend's claim once taken, else as far as its
        computed prompt shows them."""
        return self.claim.cached_tokens if self.claim is not None else self.progress.cached

    def plausible(self) -> bool:
        """The taken claim leaves no more text per token than real text has."""
        c = self.claim
        return c is not None and self.chars <= PLAUSIBLE_CHARS_PER_TOKEN * c.completion_tokens

    def take(self, chunk: GenChunk) -> GenChunk | None:
        """The chunk as it may go to the client; None for nothing more. A chunk that
        would pass max_tokens or the text bound ends the choice with "length" instead."""
        if self.finished:
            return None
        ids = len(chunk.token_ids)
        logprobs = None if chunk.logprobs is None else self._logprobs(chunk.logprobs, ids)
        text = chunk.text
        parsed = type(chunk) is ParsedChunk  # an upstream's reasoning and calls count too
        if parsed:
            text += chunk.parsed_text()  # type: ignore[attr-defined]
        tokens = ids or max(len(logprobs or ()), 1 if text else 0)
        chars = len(text)
        if logprobs:  # once a chunk: no generator for the common chunk without them
            chars += sum(_chars(lp) for lp in logprobs)
        if (
            self.ids + self.pieces + tokens > self.max_tokens
            or self.chars + chars > self.max_tokens * MAX_CHARS_PER_TOKEN
        ):
            log.warning("request %s: output past max_tokens cut", self.request_id)
            self.finished = True
            return GenChunk([], "", "length")
        self.chars += chars
        if chunk.token_ids:
            self.ids += tokens
        elif tokens:
            self.pieces += tokens
            self.text.append(text)
        prompt_logprobs = chunk.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = [
                None if lp is None else self._cut(lp)
                for lp in prompt_logprobs[: self.prompt_tokens]
            ]
        usage = None
        if chunk.finish_reason is not None:
            self.finished = True
            if chunk.usage is not None:
                self._claim(chunk.usage)
            usage = self.claim
        fields = (
            [*chunk.token_ids],
            chunk.text,
            chunk.finish_reason,
            usage,
            logprobs,
            prompt_logprobs,
            chunk.stop_sequence,
        )
        if parsed:
            return ParsedChunk(*fields, chunk.reasoning, chunk.tool_calls)  # type: ignore[attr-defined]
        return GenChunk(*fields)

    def _logprobs(self, items: list[TokenLogprob], ids: int) -> list[TokenLogprob] | None:
        """What was asked for: none without `logprobs`, each entry's top cut to it, and
        no more entries than the chunk's token ids where it has them."""
        if self.top_logprobs is None:
            return None
        return [self._cut(lp) for lp in (items[:ids] if ids else items)]

    def _cut(self, lp: TokenLogprob) -> TokenLogprob:
        top = self.top_logprobs or 0
        return lp if len(lp.top) <= top else TokenLogprob(lp.token, lp.logprob, lp.top[:top])

    def _claim(self, usage: Usage) -> None:
        prompt = self.prompt_tokens
        if self.prompt_bound and 0 < usage.prompt_tokens <= prompt:
            prompt = usage.prompt_tokens
        elif self.prompt_bound and usage.prompt_tokens > prompt:  # billed at the bound
            log.warning(
                "request %s: the upstream counted %d prompt tokens, past the %d reserved for "
                "it (an image chat's: its entry's image_tokens is too low?)",
                *(self.request_id, usage.prompt_tokens, prompt),
            )
        if not 0 <= usage.cached_tokens <= prompt:
            why = f"cached_tokens {usage.cached_tokens} outside [0, {prompt}]"
        elif not self.delivered <= usage.completion_tokens <= self.max_tokens:
            why = (
                f"completion_tokens {usage.completion_tokens} outside "
                f"[{self.delivered} delivered, {self.max_tokens} max_tokens]"
            )
        elif usage.counted_by not in COUNTERS:
            why = f"counted_by {usage.counted_by!r}"
        elif not 0 <= usage.image_tokens <= prompt:
            why = f"image_tokens {usage.image_tokens} outside [0, {prompt}]"
        else:
            c, images = usage.completion_tokens, usage.image_tokens
            self.claim = Usage(prompt, c, usage.cached_tokens, usage.counted_by, images)
            return
        self.refuse(why)

    def refuse(self, why: str) -> None:
        """The backend's usage is not taken: the gateway's own count stands."""
        log.warning("request %s: the backend's usage is not taken: %s", self.request_id, why)
        self.claim, self.refused = None, why

    def billed(self, text_tokens: int | None) -> tuple[int, str]:
        """(completion tokens, who counted them) for the usage row. `text_tokens`: the
        tokenizer's count of the text delivered without ids, where one was made."""
        claim = self.claim
        if claim is not None and text_tokens is not None:
            own = self.ids + text_tokens
            if abs(claim.completion_tokens - own) > max(2, own // 10):
                self.refuse(f"completion_tokens {claim.completion_tokens}, counted {own}")
        if self.claim is not None:
            return self.claim.completion_tokens, self.claim.counted_by
        own = self.ids + max(self.pieces, text_tokens or 0)
        return min(own, self.max_tokens), "gateway" if self.pieces or self.refused else "engine"


def _chars(lp: TokenLogprob) -> int:
    return len(lp.token) + sum(len(t) for t, _ in lp.top)


async def metered(gen: AsyncIterator[GenChunk], meter: ChoiceMeter) -> AsyncIterator[GenChunk]:
    """`gen`'s chunks through `meter`; at a cut, `gen` is closed, which aborts the
    request in the engine or upstream."""
    try:
        async for chunk in gen:
            out = meter.take(chunk)
            if out is not None:
                yield out
            if meter.finished:
                return
    finally:
        await gen.aclose()
