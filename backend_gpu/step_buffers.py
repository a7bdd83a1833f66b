"""The model runner's step inputs, allocated once and filled in place every step.

A step's flat token ids, positions, slot mapping, block tables, context lengths, query
offsets and sampled rows are written on the host (through numpy views, the cheapest way
from Python lists) and, on CUDA, copied to device buffers of the same shape with
non-blocking copies from pinned memory: one transfer per buffer, no allocation, and
addresses that stay put, which the CUDA graphs (cuda_graphs.py) need, as they read
their inputs where they were captured. On the CPU the device buffers are the host ones.

A pinned buffer must not be refilled while its last copy is still in flight: an event
recorded after the copies is waited on before the next fill (the step's read back has
normally passed it long before).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend_gpu.layers.attention import AttentionMetadata, PagedBatch
from backend_gpu.rank_handoff import StepRows

# a row per token (int64: the index ops take it); a row per sequence (int32: the
# kernels' type; query_start_loc has one more); block tables are [sequences, width]
TOKEN_BUFFERS = dict.fromkeys(
    ("input_ids", "positions", "slot_mapping", "sample_rows"), torch.int64
)
SEQ_BUFFERS = dict.fromkeys(("context_lens", "query_start_loc"), torch.int32)


@dataclass(frozen=True)
class Capacity:
    tokens: int  # rows of the flat batch (and sampled rows)
    seqs: int  # sequences in one step
    width: int  # blocks per sequence in the block table

    def holds(self, other: Capacity) -> bool:
        return other.tokens <= self.tokens and other.seqs <= self.seqs and other.width <= self.width

    def union(self, other: Capacity) -> Capacity:
        return Capacity(
            max(self.tokens, other.tokens), max(self.seqs, other.seqs), max(self.width, other.width)
        )


class StepBuffers:
    def __init__(self, capacity: Capacity, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        pinned = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        for name, dtype in TOKEN_BUFFERS.items():
            self.host[name] = torch.zeros(capacity.tokens, dtype=dtype, pin_memory=pinned)
        for name, dtype in SEQ_BUFFERS.items():
            self.host[name] = torch.zeros(capacity.seqs + 1, dtype=dtype, pin_memory=pinned)
        self.host["block_tables"] = torch.zeros(
            capacity.seqs, capacity.width, dtype=torch.int32, pin_memory=pinned
        )
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self.no_workspace = torch.empty(0, device=device)
        if pinned:
            self.dev = {name: torch.zeros_like(t, device=device) for name, t in self.host.items()}
            self.copied: torch.cuda.Event | None = torch.cuda.Event()
        else:
            self.dev = self.host
            self.copied = None

    def begin(self) -> None:
        """Before filling: the last step's copies out of the host buffers are done."""
        if self.copied is not None:
            self.copied.synchronize()

    def upload(self, num_tokens: int, num_sample_rows: int, num_seqs: int) -> None:
        """Copy the filled prefix of each host buffer to its device twin."""
        if self.copied is None:
            return
        sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens}
        sizes |= {"sample_rows": num_sample_rows, "context_lens": num_seqs}
        sizes |= {"query_start_loc": num_seqs + 1, "block_tables": num_seqs}
        for name, n in sizes.items():
            self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
        self.copied.record(torch.cuda.current_stream(self.device))

    def paged_metadata(
        self, num_tokens: int, num_seqs: int, max_query_len: int, block_size: int
    ) -> AttentionMetadata:
        """The Triton kernels' metadata over the device buffers: the block tables and
        lengths as they are, nothing gathered."""
        dev = self.dev
        return AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:num_tokens],
            block_size=block_size,
            k_workspace=self.no_workspace,
            v_workspace=self.no_workspace,
            paged=PagedBatch(
                block_tables=dev["block_tables"][:num_seqs],
                context_lens=dev["context_lens"][:num_seqs],
                query_start_loc=dev["query_start_loc"][: num_seqs + 1],
                max_query_len=max_query_len,
            ),
        )

    def fill(self, step: StepRows, block_size: int) -> None:
        """Write a batch's ids, positions, slots, tables, lengths, query offsets and
        sampled rows; sequences past the batch up to step.padded_seqs are decodes of
        nothing (length 0, their key and value written to step.scratch_slot)."""
        buf = self.np
        num_seqs, num_tokens = len(step.num_new), len(step.token_ids)
        table = buf["block_tables"]
        for i, blocks in enumerate(step.tables):
            table[i, : len(blocks)] = blocks
        new = np.asarray(step.num_new)
        ends = np.asarray(step.ends)
        q_ends = np.cumsum(new)
        buf["input_ids"][:num_tokens] = step.token_ids
        row_seq = np.repeat(np.arange(num_seqs), new)
        positions = buf["positions"][:num_tokens]
        # a sequence's new tokens end at its context's end, one position each
        np.add(np.arange(num_tokens), (ends - q_ends)[row_seq], out=positions)
        slots = buf["slot_mapping"][:num_tokens]
        np.multiply(table[row_seq, positions // block_size], block_size, out=slots)
        slots += positions % block_size
        if step.rope_positions is not None:  # the rotary's, once the slots are written
            positions[:] = step.rope_positions
        buf["context_lens"][:num_seqs] = ends
        buf["query_start_loc"][0] = 0
        buf["query_start_loc"][1 : num_seqs + 1] = q_ends
        buf["sample_rows"][: len(step.sample_rows)] = step.sample_rows
        padded = step.padded_seqs
        if padded > num_seqs:  # decodes only: one token per sequence
            buf["input_ids"][num_seqs:padded] = 0
            buf["positions"][num_seqs:padded] = 0
            buf["slot_mapping"][num_seqs:padded] = step.scratch_slot
            buf["context_lens"][num_seqs:padded] = 0
            buf["query_start_loc"][num_seqs + 1 : padded + 1] = num_tokens
