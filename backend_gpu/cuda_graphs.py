"""CUDA graphs of decode steps: one per batch size of capture_sizes(), made at start.

A decode step launches hundreds of small kernels (every layer's norms, matmuls, rotary,
cache write and attention), and at small batches their launch gaps cost more than the
work. A graph replays the whole forward in one launch. Graphs read their inputs where
they were captured: the step buffers' device tensors (step_buffers.py), sliced to the
captured size; a batch runs as the next captured size up, the extra sequences decodes
of nothing (length 0, their key and value written to a scratch block no sequence
owns). Only the model's forward is captured; the LM head runs on the real rows after.
Prefill and mixed steps stay eager: their shapes vary with every batch.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from backend_gpu.step_buffers import StepBuffers

# vLLM's sizes: 1, 2, 4, then steps of 8 to 256 and of 16 beyond
SMALL_SIZES = (1, 2, 4, *range(8, 257, 8))
LARGE_STEP = 16


def capture_sizes(max_seqs: int) -> list[int]:
    """The batch sizes to capture for decodes of up to `max_seqs` sequences."""
    sizes = [s for s in SMALL_SIZES if s <= max_seqs]
    sizes += range(SMALL_SIZES[-1] + LARGE_STEP, max_seqs + 1, LARGE_STEP)
    if not sizes or sizes[-1] != max_seqs:
        sizes.append(max_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        buffers: StepBuffers,
        sizes: list[int],
        hidden_size: int,
        dtype: torch.dtype,
        block_size: int,
        scratch_slot: int,
    ) -> None:
        self.sizes = sizes
        device = buffers.device
        self.hidden = torch.zeros(sizes[-1], hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        dev = buffers.dev
        # captured (and warmed up) as decodes of nothing: live blocks stay untouched
        for name in ("input_ids", "positions", "context_lens", "query_start_loc"):
            dev[name].zero_()
        dev["slot_mapping"].fill_(scratch_slot)
        pool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs reuse its memory in the shared pool
        for size in reversed(sizes):
            meta = buffers.paged_metadata(size, size, 1, block_size)
            ids, positions = dev["input_ids"][:size], dev["positions"][:size]
            # the warm-up compiles the Triton kernels for this size outside the capture
            self.hidden[:size] = model(ids, positions, meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = model(ids, positions, meta)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size a decode of `num_seqs` sequences runs as; None: too many."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on what the step buffers hold; its hidden states."""
        self.graphs[size].replay()
        return self.hidden[:size]
