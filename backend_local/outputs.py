"""What a decode step's logits become for one sequence: its next token (the request's
logit bias, min_tokens and ignore_eos, its grammar's mask, then its sampler chain or
plain greedy), that token's text through the stop-string stream, its logprobs and the
finish reason; and the prompt logprobs of a scored prompt chunk.

Split from worker.py, which builds and decodes the batch and owns the slots' cells and
lifetimes: this part reads one slot's rows of llama.cpp's logits and its sampling state
only, never the batch, the cells or another slot, so it stands apart (and keeps the
decode loop's file to its loop). The worker emits the output, or releases the slot
when the output finishes its request.
"""

from __future__ import annotations

import math

import llama_cpp
import numpy as np

from backend_local.grammar import GrammarMask
from backend_local.model import LlamaModel
from backend_local.requests import RequestOutput
from backend_local.sampling import token_logprob
from backend_local.slots import Slot


def logits_row(ctx: llama_cpp.llama_context_p, n_vocab: int, index: int) -> np.ndarray:
    """The logits row of batch entry `index`: a view of llama.cpp's buffer, valid until
    the next decode."""
    logits = llama_cpp.llama_get_logits_ith(ctx, index)
    return np.ctypeslib.as_array(logits, shape=(n_vocab,))


def score_prompt(
    ctx: llama_cpp.llama_context_p, n_vocab: int, slot: Slot, index: int, start: int, count: int
) -> None:
    """Add the prompt logprobs of the slot's chunk just decoded: `count` rows from batch
    entry `index`, for prompt positions from `start`. The row of position p scores token
    p + 1; the last position's row scores nothing: it gives the first output token."""
    prompt, top_n = slot.request.prompt, slot.request.params.prompt_logprobs
    for i in range(min(count, len(prompt) - 1 - start)):
        row = logits_row(ctx, n_vocab, index + i)  # read only: no copy
        slot.prompt_logprobs.append(token_logprob(row, prompt[start + i + 1], top_n))


def sample(
    ctx: llama_cpp.llama_context_p,
    model: LlamaModel,
    grammar_mask: GrammarMask,
    slot: Slot,
    index: int,
) -> RequestOutput:
    """The slot's next token from batch entry `index`'s logits, as its request's output
    (its finish_reason None while the request goes on)."""
    request = slot.request
    params = request.params
    row = logits_row(ctx, model.n_vocab, index)
    # the model's own distribution, before what follows changes the row in place
    raw = row.copy() if params.logprobs is not None else row
    if slot.logit_bias is not None:  # the chain and the argmax both read the row
        row[slot.logit_bias[0]] += slot.logit_bias[1]
    if params.ignore_eos or len(slot.output_ids) < params.min_tokens:
        row[model.eog_ids] = -math.inf
    if slot.grammar is not None:  # the chain samples from what the grammar allows
        grammar_mask.apply(row, slot.grammar)
    if slot.sampler is None:  # plain greedy
        token = int(row.argmax())
    else:
        token = llama_cpp.llama_sampler_sample(slot.sampler, ctx, index)
    if slot.grammar is not None:
        accepted = slot.grammar.consume_token(token)
        assert accepted, slot.grammar.get_error()  # the mask allowed only such tokens
    slot.output_ids.append(token)
    logprobs = None
    if params.logprobs is not None:
        logprobs = [token_logprob(raw, token, params.logprobs)]
    finish = stop = None
    if model.is_eog(token) or token in params.stop_token_ids:
        finish, text = "stop", slot.stream.flush()
    else:
        text, stop = slot.stream.add(model.piece(token, not params.skip_special_tokens))
        if stop is not None:
            finish = "stop"
        elif len(slot.output_ids) >= params.max_tokens:
            finish, text = "length", text + slot.stream.flush()
    output = RequestOutput(
        request.request_id,
        [token],
        text,
        finish,
        logprobs=logprobs,
        prompt_logprobs=slot.prompt_logprobs,
        stop_sequence=stop,
    )
    slot.prompt_logprobs = None  # the first output carries them
    return output
