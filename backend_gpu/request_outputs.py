"""From a request's sampled tokens to what the engine hands back: the tokens appended
one by one (each through its grammar) until one ends the request (its stop tokens,
EOS, a stop string, its length), and the RequestOutput of a step (text delta,
logprobs, prompt logprobs on the first output). Apart from the engine loop
(engine.py), which owns the requests' state (sequences, detokenizers, blocks) and
calls these per sequence and per output; nothing is held here between calls.
"""

from __future__ import annotations

from backend_gpu.detokenizer import IncrementalDetokenizer
from backend_gpu.outputs import RequestOutput
from backend_gpu.sequence import Logprob, Sequence


def eos_token_ids(model_dir_or_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (model_dir_or_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def append_tokens(
    seq: Sequence,
    tokens: list[int],
    detok: IncrementalDetokenizer,
    eos_token_ids: set[int],
    max_model_len: int,
) -> tuple[list[int], str | None]:
    """Append tokens one by one until one stops the request; return those appended
    and the finish reason."""
    emitted: list[int] = []
    reason = None
    for token in tokens:
        seq.token_ids.append(token)
        emitted.append(token)
        if seq.grammar is not None:
            # the mask allowed only tokens it accepts: a refusal is a bug to see
            accepted = seq.grammar.consume_token(token)
            assert accepted, seq.grammar.get_error()
        reason = check_stop(seq, token, detok, eos_token_ids, max_model_len)
        if reason is not None:
            break
    return emitted, reason


def check_stop(
    seq: Sequence,
    token: int,
    detok: IncrementalDetokenizer,
    eos_token_ids: set[int],
    max_model_len: int,
) -> str | None:
    """The finish reason `token`, just appended to `seq`, gives it (None: it goes on);
    feeds the token to the request's detokenizer."""
    p = seq.params
    ending = seq.num_output_tokens >= p.min_tokens
    if ending and token in p.stop_token_ids:
        seq.stop_reason = token  # a stop token is not text, special tokens kept or not
        return "stop"
    if ending and not p.ignore_eos and token in eos_token_ids:
        return "stop"
    stop_string = detok.add([token])
    if ending and stop_string is not None:
        seq.stop_reason = stop_string
        return "stop"
    if seq.num_output_tokens >= p.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def request_output(
    seq: Sequence, detok: IncrementalDetokenizer, new_tokens: list[int]
) -> RequestOutput:
    """`seq`'s output after a step that appended `new_tokens` (its text delta up to
    the end once it is finished)."""
    finished = seq.is_finished
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
        token_ids=seq.output_token_ids,
        text=detok.output_text,
        new_token_ids=new_tokens,
        text_delta=detok.take_delta(finished),
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=list(seq.logprobs),
        prompt_logprobs=_prompt_logprobs(seq, new_tokens),
        num_image_tokens=seq.images.num_image_tokens if seq.images is not None else 0,
    )


def _prompt_logprobs(seq: Sequence, new_tokens: list[int]) -> list[Logprob | None] | None:
    """The prompt logprobs asked for, on the request's first output with tokens
    (the step that ends the prefill has recorded them all), None first; else None."""
    first = bool(new_tokens) and len(new_tokens) == seq.num_output_tokens
    if seq.params.prompt_logprobs is None or not first:  # an abort before it: none
        return None
    assert not seq.prompt_logprobs_pending
    return [None, *seq.prompt_logprobs]
