"""How many KV blocks one rank's memory allows, decided once at start: apart from the
runner (model_runner.py), which only allocates what this decides, so that the
measuring (a profiling forward, the device's free memory) reads as one piece.

The KV cache takes what is left: on CUDA gpu_memory_utilization of the GPU's memory,
less what is already used (the weights, other processes), the activations' peak,
measured by one profiling forward of max_num_batched_tokens tokens, and the CUDA
graphs' pool (estimated: they are captured after the cache); on the CPU a share
of free RAM; kv_cache_memory_bytes, when set, on any device. A cache that cannot hold
one sequence of max_model_len tokens is an error, not a silently useless engine.
The sums are memory.py's, which `kvgate plan` calls too; only the measuring is here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backend_gpu.config import EngineConfig
from backend_gpu.distributed import ParallelGroup
from backend_gpu.layers.attention import AttentionMetadata, PagedBatch
from backend_gpu.memory import (
    MIB,
    KVCacheSize,
    KVShape,
    cpu_kv_budget,
    device_kv_budget,
    graph_pool_bytes,
    kv_cache_size,
    step_shape_of,
)
from backend_gpu.pp_stages import Stage, stage_forward

log = logging.getLogger(__name__)


def _size(num_bytes: int) -> str:
    if num_bytes < MIB:
        return f"{max(num_bytes, 0) / 1024:.1f} KiB"
    return f"{num_bytes / MIB:.1f} MiB"


@dataclass(frozen=True)
class KVSizing:
    """What sizing one rank's KV cache reads: the settings, the model as loaded (its
    stage's layers), and the shape of the cache's rows."""

    config: EngineConfig
    hf_config: Any  # the model's transformers config
    model: nn.Module
    stage: Stage
    attention_layers: list[nn.Module]  # the stage's; the profile gives them scratch caches
    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype
    kv_shape: tuple[int, int]  # (KV heads on this rank, head dim)
    kv_tensors: int  # K and V: 2; MLA's one row: 1 (memory.KVShape)
    max_model_len: int
    logit_rows: int  # rows of logits a step holds at once (memory.logit_rows)
    weight_bytes: int
    tp_size: int
    graph_seqs: int  # the largest decode batch captured as a CUDA graph; 0: no graphs
    # a vision model's largest image, its patch grid (the profile encodes one), and the
    # encoder cache's bytes (kept beside the KV cache); None and 0 for a text model
    vision_grid: tuple[int, int, int] | None = None
    encoder_cache_bytes: int = 0

    def size(self, world: ParallelGroup) -> KVCacheSize:
        """The cache's blocks, the same on every rank of `world` (the least any rank's
        budget holds); a ValueError, naming the setting to change, when they do not
        hold one sequence of max_model_len tokens."""
        config = self.config
        if self.device.type == "cuda":
            # free the unquantized weights and the calibration's scratch before sizing
            torch.cuda.empty_cache()
        size = kv_cache_size(
            KVShape(
                len(self.attention_layers),
                *self.kv_shape,
                self.kv_dtype.itemsize,
                self.kv_tensors,
            ),
            config.block_size,
            self.budget(),
            self.max_model_len,
            # the CPU's default budget: no more than every sequence at full length
            config.max_num_seqs
            if config.kv_cache_memory_bytes is None and self.device.type == "cpu"
            else None,
        )
        needed = size.blocks_per_seq
        # every rank holds the same block ids: as many as the tightest rank's budget
        size = dataclasses.replace(size, num_blocks=world.min_over_ranks(size.num_blocks))
        if size.num_blocks < needed:
            raise ValueError(
                f"the KV cache budget ({_size(size.budget)}) holds {size.num_blocks} "
                f"blocks of {config.block_size} tokens, fewer than the {needed} blocks "
                f"({_size(needed * size.bytes_per_block)}) one sequence of max_model_len "
                f"{self.max_model_len} tokens needs: {self.hint()}"
            )
        return size

    def hint(self) -> str:
        """The setting to change when the budget is too small."""
        if self.config.kv_cache_memory_bytes is not None:
            return "raise kv_cache_memory_bytes or lower max_model_len"
        if self.device.type == "cuda":
            return (
                f"raise gpu_memory_utilization (now {self.config.gpu_memory_utilization}) "
                "or lower max_model_len"
            )
        return "free memory, set kv_cache_memory_bytes or lower max_model_len"

    def budget(self) -> int:
        """Bytes the KV cache may take on this rank."""
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            activations = self.profile_activations() + self.encoder_cache_bytes
            graph_pool = graph_pool_bytes(
                step_shape_of(self.hf_config, self.tp_size, self.dtype.itemsize),
                self.graph_seqs,
            )
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # the weights, the CUDA context, other processes
            budget = device_kv_budget(
                total, config.gpu_memory_utilization, used, activations, graph_pool
            )
            log.info(
                "KV cache budget %.0f MiB: %.0f%% of %.0f MiB, less %.0f MiB in use "
                "(weights %.0f MiB), %.0f MiB of activations and %.0f MiB of CUDA graphs",
                budget / MIB,
                100 * config.gpu_memory_utilization,
                total / MIB,
                used / MIB,
                self.weight_bytes / MIB,
                activations / MIB,
                graph_pool / MIB,
            )
            return budget
        return cpu_kv_budget(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))

    @torch.inference_mode()
    def profile_activations(self) -> int:
        """Peak bytes a step adds over the weights (CUDA only): one prefill of
        max_num_batched_tokens tokens through the kernels, then logits of logit_rows
        rows (as many as a step samples, or a slice of prompt logprobs). It leaves the
        attention layers with empty caches."""
        device, bs = self.device, self.config.block_size
        tokens = self.config.max_num_batched_tokens
        num_blocks = -(-tokens // bs)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        # one scratch cache for every layer: their writes clash, the sizes are the same
        cache = torch.zeros((num_blocks * bs, *self.kv_shape), dtype=self.kv_dtype, device=device)
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = cache
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, device=device),
            block_size=bs,
            k_workspace=cache[:0],
            v_workspace=cache[:0],
            paged=PagedBatch(
                block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
                context_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
                max_query_len=tokens,
            ),
        )
        positions = torch.arange(tokens, device=device) % self.max_model_len
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        # a vision model's step encodes an image first and holds its output through the
        # step: one image at the configured limit (backend_gpu.multimodal)
        image = self.encode_largest_image() if self.vision_grid is not None else None
        if self.stage.count == 1:
            hidden = self.model(ids, positions, meta)
        else:  # a later stage's input: as many hidden states
            hidden_size = self.hf_config.hidden_size
            x = torch.zeros(tokens, hidden_size, dtype=self.dtype, device=device)
            hidden = stage_forward(self.model, self.stage, ids, positions, meta, x)
        # the sampler's float32 logits and one vocabulary-sized temporary beside them
        logits = self.model.compute_logits(hidden[: self.logit_rows]) if self.stage.last else None
        if logits is not None:  # rank 0's, under tensor parallelism
            logits.float().softmax(-1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = cache[:0]
        del cache, hidden, meta, image
        torch.cuda.empty_cache()
        return peak

    def encode_largest_image(self) -> torch.Tensor:
        """The tower's output for an image of the largest grid (random pixels)."""
        patches = self.model.image_input_like(self.vision_grid, self.device)
        return self.model.encode_image(patches, self.vision_grid)
