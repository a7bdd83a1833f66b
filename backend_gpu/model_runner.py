"""Runs the model on a scheduled batch: owns the weights and the paged KV cache and
turns the batch into flat token ids, positions, slot mapping and context slots, in
buffers allocated once (step_buffers.py); on CUDA, decodes replay CUDA graphs
(cuda_graphs.py).

The KV cache takes what is left: on CUDA gpu_memory_utilization of the GPU's memory,
less what is already used (the weights, other processes) and the activations' peak,
measured by one profiling forward of max_num_batched_tokens tokens; on the CPU a share
of free RAM; kv_cache_memory_bytes, when set, on any device. A cache that cannot hold
one sequence of max_model_len tokens is an error, not a silently useless engine.
"""

from __future__ import annotations

import logging
import os

import torch

from backend_gpu.config import EngineConfig
from backend_gpu.cuda_graphs import DecodeGraphs, capture_sizes
from backend_gpu.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    DecodeSpan,
    PagedBatch,
    PrefillSpan,
)
from backend_gpu.loader import build_model
from backend_gpu.models.llama import head_dim_of
from backend_gpu.quantization import KV_CACHE_DTYPES
from backend_gpu.quantization.fp8 import FP8
from backend_gpu.quantization.kv_calibration import calibrate_kv_scales, calibration_token_ids
from backend_gpu.quantization.model import quantize_model
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.step_buffers import Capacity, StepBuffers, StepRows

log = logging.getLogger(__name__)

# a decode joins the current group while its context is at least this share of the
# group's longest; below, padding it would cost more than one more attention call
DECODE_GROUP_FILL = 0.7
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIB = 1 << 20


def _size(num_bytes: int) -> str:
    if num_bytes < MIB:
        return f"{max(num_bytes, 0) / 1024:.1f} KiB"
    return f"{num_bytes / MIB:.1f} MiB"


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, weights, tokenizer) -> None:
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.model = build_model(
            hf_config, self.dtype, self.device, weights, config.load_format, config.seed
        )
        if config.quantization is not None:
            quantize_model(self.model, config.quantization)
        self.model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.attention_layers = [layer.self_attn for layer in self.model.model.layers]
        self.max_model_len = config.context_len(hf_config)
        self.hidden_size = hf_config.hidden_size
        self.kv_shape = (hf_config.num_key_value_heads, head_dim_of(hf_config))
        self.kv_row = self.kv_shape[0] * self.kv_shape[1]
        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype
        if self.kv_dtype == FP8:  # before the cache exists: calibration uses scratch rows
            calibrate_kv_scales(
                self.model,
                self.attention_layers,
                calibration_token_ids(tokenizer, self.max_model_len),
                self.kv_shape,
                self.dtype,
                self.device,
            )
        # the one switch between attention paths: CUDA runs the Triton kernels, which read
        # the cache through the block tables; elsewhere the torch spans gather it
        self.paged_kernels = self.device.type == "cuda"
        capacity = Capacity(
            tokens=config.max_num_batched_tokens,
            # under VTC one seat beyond max_num_seqs (scheduler.py); each has a token
            seqs=min(config.max_num_seqs + 1, config.max_num_batched_tokens),
            width=-(-self.max_model_len // self.block_size),
        )
        self.buffers = StepBuffers(capacity, self.device)
        self._allocate_kv_cache(config)
        self.k_workspace = self.v_workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        self.graphs: DecodeGraphs | None = None
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graph_max_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.num_graph_steps = 0  # decode steps that replayed a graph
        if self.use_graphs:
            self._capture_graphs()

    def _allocate_kv_cache(self, config: EngineConfig) -> None:
        bytes_per_block = (
            2 * len(self.attention_layers) * self.block_size * self.kv_row
        ) * self.kv_dtype.itemsize
        if self.device.type == "cuda":
            # free the unquantized weights and the calibration's scratch before sizing
            torch.cuda.empty_cache()
        budget = self._kv_budget(config)
        if config.kv_cache_memory_bytes is None and self.device.type == "cpu":
            # no point holding more than every sequence at full length
            budget = min(
                budget,
                config.max_num_seqs * self.max_model_len * bytes_per_block // self.block_size,
            )
        self.num_blocks = max(0, budget // bytes_per_block)
        needed = -(-self.max_model_len // self.block_size)
        if self.num_blocks < needed:
            raise ValueError(
                f"the KV cache budget ({_size(budget)}) holds {self.num_blocks} "
                f"blocks of {self.block_size} tokens, fewer than the {needed} blocks "
                f"({_size(needed * bytes_per_block)}) one sequence of max_model_len "
                f"{self.max_model_len} tokens needs: {self._budget_hint(config)}"
            )
        self.kv_cache_bytes = self.num_blocks * bytes_per_block
        # one block more, which the block manager never hands out: CUDA graphs pad
        # decodes with sequences that write their key and value there
        self.scratch_slot = self.num_blocks * self.block_size
        shape = ((self.num_blocks + 1) * self.block_size, *self.kv_shape)
        for attn in self.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _budget_hint(self, config: EngineConfig) -> str:
        if config.kv_cache_memory_bytes is not None:
            return "raise kv_cache_memory_bytes or lower max_model_len"
        if self.device.type == "cuda":
            return (
                f"raise gpu_memory_utilization (now {config.gpu_memory_utilization}) "
                "or lower max_model_len"
            )
        return "free memory, set kv_cache_memory_bytes or lower max_model_len"

    def _kv_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            activations = self._profile_activations(config)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # the weights, the CUDA context, other processes
            budget = int(total * config.gpu_memory_utilization) - used - activations
            log.info(
                "KV cache budget %.0f MiB: %.0f%% of %.0f MiB, less %.0f MiB in use "
                "(weights %.0f MiB) and %.0f MiB of activations",
                budget / MIB,
                100 * config.gpu_memory_utilization,
                total / MIB,
                used / MIB,
                self.weight_bytes / MIB,
                activations / MIB,
            )
            return budget
        free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(2 << 30, free_ram // 10)

    @torch.inference_mode()
    def _profile_activations(self, config: EngineConfig) -> int:
        """Peak bytes a step adds over the weights: one prefill of max_num_batched_tokens
        tokens through the kernels, then logits of as many rows as a step samples."""
        device, bs = self.device, self.block_size
        tokens = config.max_num_batched_tokens
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
        hidden = self.model(torch.zeros(tokens, dtype=torch.long, device=device), positions, meta)
        rows = min(tokens, config.max_num_seqs + 1)
        # the sampler's float32 logits and one vocabulary-sized temporary beside them
        self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = cache[:0]
        del cache, hidden, meta
        torch.cuda.empty_cache()
        return peak

    def _capture_graphs(self) -> None:
        self.graphs = None  # the old graphs' memory goes back before new ones are made
        sizes = capture_sizes(min(self.graph_max_seqs, self.buffers.capacity.seqs))
        with torch.inference_mode(), torch.cuda.device(self.device):
            self.graphs = DecodeGraphs(
                self.model,
                self.buffers,
                sizes,
                self.hidden_size,
                self.dtype,
                self.block_size,
                self.scratch_slot,
            )
        log.info("captured %d CUDA graphs of decode steps (batches %s)", len(sizes), sizes)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Compute the batch; return logits (float32) of the sequences that reach their
        end this step, 1 + len(spec_token_ids) rows each, and their indices in the batch."""
        graph_size = None
        if self.graphs is not None and max(batch.num_new_tokens) == 1:
            graph_size = self.graphs.size_for(len(batch.seqs))
        input_ids, positions, meta, sample_rows, sampled = self.prepare(batch, graph_size)
        if graph_size is not None:
            hidden = self.graphs.replay(graph_size)
            self.num_graph_steps += 1
        else:
            hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[sample_rows])
        return logits.float(), sampled

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for `num_blocks` gathered blocks of K and of V, reused across steps
        (fresh big allocations each layer would cost page faults)."""
        needed = num_blocks * self.block_size * self.kv_row
        if self.k_workspace.numel() < needed:
            self.k_workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
            self.v_workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
        return self.k_workspace, self.v_workspace

    def _group_decodes(self, decodes: list[int], ends: list[int]) -> list[list[int]]:
        """Split decodes, longest first, into groups whose padding to their longest
        member stays small; each group is one padded attention batch."""
        groups: list[list[int]] = []
        for i in sorted(decodes, key=lambda i: -ends[i]):
            if groups and ends[i] >= DECODE_GROUP_FILL * ends[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def prepare(self, batch: ScheduledBatch, graph_size: int | None = None):
        """Fill the step buffers; return (input ids, positions, attention metadata,
        sampled rows, sampled sequences' indices). With `graph_size` (a decode batch) the
        buffers are padded to that many sequences for the graph of that size."""
        ids: list[int] = []
        ends: list[int] = []
        q_ends: list[int] = []
        rows: list[int] = []
        sampled: list[int] = []
        q_end = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            end = seq.num_computed_tokens + n
            ids.extend(seq.token_ids[seq.num_computed_tokens : end])
            ids.extend(seq.spec_token_ids)  # the scheduler kept only those it scheduled
            q_end += n
            ends.append(end)
            q_ends.append(q_end)
            num_spec = len(seq.spec_token_ids)
            if end == len(seq) + num_spec:
                sampled.append(i)
                # a sequence verifying k proposed tokens samples at its last k + 1 positions
                rows.extend(range(q_end - 1 - num_spec, q_end))
        num_seqs = graph_size or len(batch.seqs)
        num_tokens = graph_size or len(ids)
        tables = [s.block_table for s in batch.seqs]
        self._reserve(Capacity(num_tokens, num_seqs, max(map(len, tables))))
        buffers = self.buffers
        buffers.begin()
        step = StepRows(ids, batch.num_new_tokens, ends, tables, rows, num_seqs, self.scratch_slot)
        buffers.fill(step, self.block_size)
        buffers.upload(num_tokens, len(rows), num_seqs)
        if self.paged_kernels:
            meta = buffers.paged_metadata(
                num_tokens, num_seqs, max(batch.num_new_tokens), self.block_size
            )
        else:
            meta = self._span_meta(batch, ends, q_ends, num_tokens)
        dev = buffers.dev
        return (
            dev["input_ids"][:num_tokens],
            dev["positions"][:num_tokens],
            meta,
            dev["sample_rows"][: len(rows)],
            sampled,
        )

    def _reserve(self, needed: Capacity) -> None:
        """Grow the step buffers for a batch beyond their size (a draft model catching
        up on whole prompts; the target's batches always fit), recapturing the graphs,
        which read the old buffers."""
        if self.buffers.capacity.holds(needed):
            return
        grown = Capacity(1 << (needed.tokens - 1).bit_length(), needed.seqs, needed.width).union(
            self.buffers.capacity
        )
        log.info("step buffers grow to %s", grown)
        self.buffers = StepBuffers(grown, self.device)
        if self.use_graphs:
            self._capture_graphs()

    def _span_meta(self, batch, ends, q_ends, num_tokens) -> AttentionMetadata:
        """The torch attention's metadata: decodes in padded groups (or one by one) and
        prefill chunks, each with its blocks, and workspaces to gather them into."""
        bs = self.block_size
        decodes = [i for i, n in enumerate(batch.num_new_tokens) if n == 1]
        prefills = [i for i, n in enumerate(batch.num_new_tokens) if n > 1]
        # one thread on a CPU: decodes one by one, measured faster there (no padding, a
        # cache-sized workspace); else padded groups, whose SDPA spreads over threads
        one_by_one = self.device.type == "cpu" and torch.get_num_threads() == 1
        groups = [] if one_by_one else self._group_decodes(decodes, ends)
        gathered = [len(g) * -(-ends[g[0]] // bs) for g in groups]
        gathered += [-(-end // bs) for end in ends]
        k_ws, v_ws = self._workspace(max(gathered))
        device_tables = self.buffers.dev["block_tables"]
        meta = AttentionMetadata(
            slot_mapping=self.buffers.dev["slot_mapping"][:num_tokens],
            block_size=bs,
            k_workspace=k_ws,
            v_workspace=v_ws,
        )
        for group in groups:
            num_blocks = -(-ends[group[0]] // bs)
            meta.decode_groups.append(
                DecodeGroup(
                    rows=torch.tensor([q_ends[i] - 1 for i in group], device=self.device),
                    block_ids=device_tables[group, :num_blocks].flatten(),
                    lens=torch.tensor([ends[i] for i in group], device=self.device),
                )
            )
        if one_by_one:
            meta.decodes = [
                DecodeSpan(q_ends[i] - 1, ends[i], device_tables[i, : -(-ends[i] // bs)])
                for i in decodes
            ]
        for i in prefills:
            n = batch.num_new_tokens[i]
            meta.prefills.append(
                PrefillSpan(
                    q_start=q_ends[i] - n,
                    q_end=q_ends[i],
                    start_pos=ends[i] - n,
                    block_ids=device_tables[i, : -(-ends[i] // bs)],
                )
            )
        return meta
