"""Pipeline parallelism's runner: each rank runs its stage's layers on every micro-batch
of a step and passes the hidden states on to the same tensor-parallel rank of the next
stage (torch.distributed send/recv over the group of all ranks: gloo on the CPU, NCCL
on CUDA).

The engine's process holds the last stage (its tensor-parallel rank 0): it computes the
logits and samples where the scheduler and the sampler's per-request state are, so
only hidden states travel between processes, never logits or tokens. Each step it
splits the scheduled batch into as many micro-batches as there are stages (contiguous
runs of sequences, as even in tokens as can be), hands the rows of all of them to every
other rank at once, then takes each micro-batch's hidden states from the previous
stage in turn: while it runs micro-batch i, stage 0 already runs i + 1. A step's sends
are awaited before the next step, so a stage's buffers are never overwritten early.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from backend_gpu.model_runner import ModelRunner, StepOutput
from backend_gpu.pp_stages import stage_forward
from backend_gpu.prompt_logprobs import PromptLogprobs, prompt_targets, row_slices
from backend_gpu.rank_handoff import StepRows, step_rows
from backend_gpu.scheduler import ScheduledBatch


def micro_batches(batch: ScheduledBatch, n: int) -> list[tuple[ScheduledBatch, int]]:
    """Up to `n` contiguous runs of the batch's sequences, as even in tokens as whole
    sequences allow, each with the index of its first sequence in the batch. A batch
    that scores prompt logprobs stays whole (its spans index the whole batch)."""
    count = len(batch.seqs)
    n = min(n, count)
    if n <= 1 or batch.prompt_spans:
        return [(batch, 0)]
    prefix = list(itertools.accumulate(batch.num_new_tokens))
    cuts = [0]
    for k in range(1, n):
        cut = bisect.bisect_left(prefix, batch.num_tokens * k / n) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), count - (n - k)))
    cuts.append(count)
    return [
        (ScheduledBatch(batch.seqs[a:b], batch.num_new_tokens[a:b]), a)
        for a, b in itertools.pairwise(cuts)
    ]


class PipelineRunner(ModelRunner):
    """One pipeline stage's runner (one tensor-parallel rank of it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # sends not yet known to be done, with their tensors (alive until they are)
        self.sends: list[tuple[object, torch.Tensor]] = []

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """The engine's process (the last stage): run the batch through every stage, a
        micro-batch at a time, and return what ModelRunner.run does."""
        assert self.ranks is not None and self.stage.last and self.tp.rank == 0
        spans = batch.prompt_spans
        prompt_rows = row_slices(spans, self.logit_rows)
        targets = None
        if spans:
            ids, top_n = prompt_targets(batch.seqs, spans)
            targets = (torch.tensor(ids, device=self.device), top_n)
        parts = [
            (*step_rows(part, None, prompt_rows, self.scratch_slot, self.lora is not None), first)
            for part, first in micro_batches(batch, self.stage.count)
        ]
        logits: list[torch.Tensor] = []
        sampled: list[int] = []
        scored = None
        try:
            self.ranks.send([step for step, _, _ in parts])
            for step, part_sampled, first in parts:
                part_logits, scored = self.run_stage(step, targets)
                logits.append(part_logits)
                sampled += [first + i for i in part_sampled]
        except RuntimeError as exc:  # a send, receive or collective failed: a rank is gone
            raise self.ranks.failure(exc) from exc
        prompt = PromptLogprobs(spans, *scored) if scored is not None else None
        return StepOutput(torch.cat(logits), sampled, prompt)

    @torch.inference_mode()
    def execute(self, steps: list[StepRows]) -> None:
        """Every other rank: run this stage on each micro-batch the engine handed over."""
        for step in steps:
            self.run_stage(step, None)
        self.flush()

    def run_stage(self, step: StepRows, targets: tuple[torch.Tensor, int] | None):
        """This stage on one micro-batch: take the previous stage's hidden states (the
        first stage embeds the tokens), run its layers, then pass them on, or on the
        last stage run the LM head (ModelRunner.head's (logits, scored))."""
        input_ids, positions, meta, sample_rows = self.load(step)
        hidden = None
        if not self.stage.first:
            shape = (len(step.token_ids), self.hidden_size)
            hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.world.recv(hidden, self.world.rank - self.tp.size)
        x = stage_forward(self.model, self.stage, input_ids, positions, meta, hidden)
        if self.stage.last:
            return self.head(x, sample_rows, step.prompt_rows, targets)
        x = x.contiguous()
        self.sends.append((self.world.send(x, self.world.rank + self.tp.size), x))
        return None, None

    def flush(self) -> None:
        """Wait until this step's hidden states have left."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
