"""OpenAI's `echo` on completions: the prompt repeated before the completion's text and,
with `logprobs`, the prompt tokens' logprobs before the completion's (what evaluation
harnesses score a text with: lm-eval's loglikelihood sends echo, logprobs and
max_tokens 1).

The engine computes the prompt logprobs (SamplingParams.prompt_logprobs); the gateway
adds the text. A string prompt is echoed as sent, token ids as the model decodes them.
The first prompt token has no logprob (nothing comes before it), so its text is decoded
here: OpenAI lists it with a null logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends import Backend, BackendError, TokenLogprob


@dataclass(frozen=True)
class Echo:
    text: str  # the prompt as sent or decoded
    first_token: str  # its first token's text, which has no logprob

    def logprobs(
        self, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> list[TokenLogprob | str]:
        """The prompt's entries of a completion's logprobs: the first token as text alone
        (no logprob), then the engine's. BackendError if the engine sent none."""
        if not prompt_logprobs:
            raise BackendError("the backend sent no prompt logprobs for an echo with logprobs")
        return [self.first_token, *(lp for lp in prompt_logprobs[1:] if lp is not None)]


async def echoes(
    backend: Backend,
    model: str,
    sent: list[str | list[int]],
    prompts: list[list[int]],
    with_logprobs: bool,
) -> list[Echo]:
    """Each prompt's echo: `sent` as the body gave it, `prompts` as token ids; the first
    token's text only where logprobs list it."""
    out = []
    for given, ids in zip(sent, prompts, strict=True):
        text = given if isinstance(given, str) else await backend.detokenize(model, ids)
        first = await backend.detokenize(model, ids[:1]) if with_logprobs else ""
        out.append(Echo(text, first))
    return out
