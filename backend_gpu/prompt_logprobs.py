"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the
tokens before it, and the top n there, from the model's raw logits.

They come out of the prefill itself. The scheduler marks the rows of a step at prompt
positions whose next token is still in the prompt, only for the sequences that asked
(ScheduledBatch.prompt_spans); the model runner sends them through the LM head too, in
slices of at most as many rows as the memory profile measured for sampling, each
reduced to its logprobs before the next (a long prompt never holds more than one slice
of vocabulary-wide logits). Chunked prefill scores a chunk a step.

Positions already recorded are not scored again, so a request preempted and computed
again records each once; and while any is missing the request takes no prefix cache
hit (BlockManager.find_cached_blocks), as every position left must be computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend_gpu.sampler import read_back, token_logprobs
from backend_gpu.sequence import Logprob, Sequence


@dataclass
class PromptSpan:
    """One sequence's rows of a step that score its prompt: flat batch rows first_row..
    first_row + num_rows hold prompt positions first_position.., each scoring the prompt
    token after it."""

    index: int  # the sequence's index in the batch
    first_row: int
    first_position: int
    num_rows: int


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs on rank 0: row r of the tensors is the r-th row of the
    spans, in order."""

    spans: list[PromptSpan]
    chosen: torch.Tensor  # [R] the logprob of the next prompt token
    top_values: torch.Tensor  # [R, max(1, n)], n the most any span's request asked
    top_ids: torch.Tensor


def prompt_spans(seqs: list[Sequence], num_new_tokens: list[int]) -> list[PromptSpan]:
    """The rows of a step (these sequences computing that many tokens each) that score
    prompt tokens not recorded yet: each asking sequence's new positions before its
    prompt's last (whose next token is an output), from the first unrecorded one (a
    recompute after preemption skips the others)."""
    spans: list[PromptSpan] = []
    first_row = 0
    for i, (seq, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
        if seq.prompt_logprobs_pending:
            start = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
            end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if start < end:
                row = first_row + start - seq.num_computed_tokens
                spans.append(PromptSpan(i, row, start, end - start))
        first_row += n
    return spans


def row_slices(spans: list[PromptSpan], max_rows: int) -> list[tuple[int, int]]:
    """The spans' rows as (start, end) ranges of at most `max_rows` rows, in order."""
    slices = []
    for span in spans:
        end = span.first_row + span.num_rows
        for start in range(span.first_row, end, max_rows):
            slices.append((start, min(start + max_rows, end)))
    return slices


def prompt_targets(seqs: list[Sequence], spans: list[PromptSpan]) -> tuple[list[int], int]:
    """The prompt token each span row scores, in order, and the most top entries asked."""
    targets: list[int] = []
    top_n = 0
    for span in spans:
        seq = seqs[span.index]
        start = span.first_position + 1
        targets.extend(seq.token_ids[start : start + span.num_rows])
        top_n = max(top_n, seq.params.prompt_logprobs or 0)
    return targets, top_n


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    prompt_rows: list[tuple[int, int]],
    targets: tuple[torch.Tensor, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The LM head over the hidden states' prompt rows, a slice at a time, each reduced
    to (chosen, top values, top ids) before the next is computed, so a step holds one
    slice of vocabulary-wide logits (the profiled peak). Every rank calls it (the logits'
    gather is collective); rank 0, which has the scored tokens in `targets`, gets the
    rows' logprobs, the others None (so does a step without prompt rows)."""
    parts = []
    done = 0
    for start, end in prompt_rows:
        rows = compute_logits(hidden[start:end])
        if rows is not None:  # rank 0
            assert targets is not None
            ids, top_n = targets
            parts.append(token_logprobs(rows.float(), ids[done : done + end - start], top_n))
        del rows  # before the next slice's
        done += end - start
    if not parts:
        return None
    chosen, values, ids = (torch.cat(column) for column in zip(*parts, strict=True))
    return chosen, values, ids


def record_prompt_logprobs(seqs: list[Sequence], result: PromptLogprobs) -> None:
    """Append a step's prompt logprobs to its sequences (the one place that does)."""
    host = read_back(result.chosen, result.top_values, result.top_ids)
    chosen, values, ids = (t.tolist() for t in host)
    row = 0
    for span in result.spans:
        seq = seqs[span.index]
        assert span.first_position == len(seq.prompt_logprobs), "prompt logprobs out of order"
        n = seq.params.prompt_logprobs
        for position in range(span.first_position, span.first_position + span.num_rows):
            top = list(zip(ids[row][:n], values[row][:n], strict=True))
            seq.prompt_logprobs.append(Logprob(seq.token_ids[position + 1], chosen[row], top))
            row += 1
