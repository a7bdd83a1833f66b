"""What rank 0's runner hands the other ranks: each step's rows as plain lists
(StepRows), built here from the scheduled batch, and between steps the weights of a
LoRA slot (LoRASlot), sent through OtherRanks (tp_ranks.RankProcesses, down one pipe
per rank; pp_runner.py hands every stage the rows of each micro-batch).

Apart from the runner (model_runner.py), which fills its own step buffers
(step_buffers.py) from the same rows and runs the model on them: the rows are the one
form of a step that every rank reads, rank 0 included, and tp_ranks.py takes the
messages from here while the runner never imports what starts the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from backend_gpu.lora import AdapterWeights
from backend_gpu.scheduler import ScheduledBatch
from engine_api.errors import EngineDeadError


@dataclass
class StepRows:
    """One step's inputs as Python lists, before they go into the buffers: what rank 0
    hands the other tensor-parallel ranks each step."""

    token_ids: list[int]
    num_new: list[int]  # per sequence, tokens computed this step
    ends: list[int]  # per sequence, its context length after this step
    tables: list[list[int]]  # per sequence, its block table
    sample_rows: list[int]  # rows whose logits are sampled
    padded_seqs: int  # sequences the step runs as (>= len(num_new); CUDA graphs pad)
    scratch_slot: int  # where padding sequences write their key and value
    graph: bool = False  # a decode run by the CUDA graph of padded_seqs sequences
    # row ranges whose logits score prompt logprobs (backend_gpu.prompt_logprobs): every
    # rank runs the LM head on them too, as the logits' gather is collective
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    # per sequence, its LoRA adapter's slot (-1: none; backend_gpu.lora); empty: none at all
    lora_slots: list[int] = field(default_factory=list)
    # per row, its rotary position where that is not its index (an M-RoPE model's text
    # rows after an image: backend_gpu.multimodal); None: the indices
    rope_positions: np.ndarray | None = None
    # per row, the index of the last key it attends to where some row sees past itself
    # (a Gemma 3 image's tokens see the whole image: backend_gpu.multimodal); None: causal
    key_last: np.ndarray | None = None


@dataclass
class LoRASlot:
    """Rank 0 to the other ranks, between steps: put `weights` in LoRA slot `slot` (None:
    clear it); each rank keeps its own share (LoRAStacks)."""

    slot: int
    weights: AdapterWeights | None


class OtherRanks(Protocol):
    """Rank 0's handle on the other tensor-parallel ranks (tp_ranks.RankProcesses, which
    starts runners: a protocol here, so that the runner never imports what starts it)."""

    def send(self, step: StepRows | LoRASlot | list[StepRows]) -> None: ...

    def check(self) -> None: ...

    def failure(self, exc: BaseException) -> EngineDeadError: ...

    def close(self) -> None: ...


def step_rows(
    batch: ScheduledBatch,
    graph_size: int | None,
    prompt_rows: list[tuple[int, int]],
    scratch_slot: int,
    lora: bool,
) -> tuple[StepRows, list[int]]:
    """The step's rows and the sampled sequences' indices in the batch; `lora`: the
    runner has LoRA slots (the rows then carry each sequence's)."""
    ids: list[int] = []
    ends: list[int] = []
    rows: list[int] = []
    sampled: list[int] = []
    q_end = 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        end = seq.num_computed_tokens + n
        ids.extend(seq.token_ids[seq.num_computed_tokens : end])
        ids.extend(seq.spec_token_ids)  # the scheduler kept only those it scheduled
        q_end += n
        ends.append(end)
        num_spec = len(seq.spec_token_ids)
        if end == len(seq) + num_spec:
            sampled.append(i)
            # a sequence verifying k proposed tokens samples at its last k + 1 positions
            rows.extend(range(q_end - 1 - num_spec, q_end))
    tables = [s.block_table for s in batch.seqs]
    step = StepRows(
        ids,
        list(batch.num_new_tokens),
        ends,
        tables,
        rows,
        graph_size or len(batch.seqs),
        scratch_slot,
        graph_size is not None,
        prompt_rows,
        [s.lora_slot for s in batch.seqs] if lora else [],
    )
    return step, sampled
