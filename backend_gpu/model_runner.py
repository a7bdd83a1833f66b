"""Runs the model on a scheduled batch: owns the weights and the paged KV cache and
turns the batch into flat token ids, positions, slot mapping and context slots."""

from __future__ import annotations

import os

import torch

from backend_gpu.config import EngineConfig
from backend_gpu.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    DecodeSpan,
    PagedBatch,
    PrefillSpan,
)
from backend_gpu.loader import load_weights
from backend_gpu.models import model_class
from backend_gpu.models.llama import head_dim_of
from backend_gpu.quantization import KV_CACHE_DTYPES
from backend_gpu.quantization.fp8 import FP8
from backend_gpu.quantization.kv_calibration import calibrate_kv_scales, calibration_token_ids
from backend_gpu.quantization.model import quantize_model
from backend_gpu.scheduler import ScheduledBatch

# a decode joins the current group while its context is at least this share of the
# group's longest; below, padding it would cost more than one more attention call
DECODE_GROUP_FILL = 0.7
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, weights, tokenizer) -> None:
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        if self.dtype is torch.float16 and self.device.type == "cpu":
            raise ValueError("float16 is for CUDA; use float32 or bfloat16 on the CPU")
        self.block_size = config.block_size
        torch.manual_seed(config.seed)  # the initial (overwritten) weights stay reproducible
        with torch.device(self.device):
            architecture = (hf_config.architectures or [hf_config.model_type])[0]
            self.model = model_class(architecture)(hf_config).to(self.dtype)
        load_weights(self.model, weights)
        if config.quantization is not None:
            quantize_model(self.model, config.quantization)
        self.model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.attention_layers = [layer.self_attn for layer in self.model.model.layers]
        num_kv_heads = hf_config.num_key_value_heads
        head_dim = head_dim_of(hf_config)
        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype
        if self.kv_dtype == FP8:  # before the cache exists: calibration uses scratch rows
            calibrate_kv_scales(
                self.model,
                self.attention_layers,
                calibration_token_ids(tokenizer, config.context_len(hf_config)),
                (num_kv_heads, head_dim),
                self.dtype,
                self.device,
            )
        if self.device.type == "cuda":
            # free the unquantized weights and the calibration's scratch before sizing the cache
            torch.cuda.empty_cache()
        bytes_per_block = (
            2 * len(self.attention_layers) * self.block_size * num_kv_heads * head_dim
        ) * self.kv_dtype.itemsize
        budget = self._kv_budget(config)
        if config.kv_cache_memory_bytes is None and self.device.type == "cpu":
            # no point holding more than every sequence at full length
            max_len = config.max_model_len or hf_config.max_position_embeddings
            budget = min(budget, config.max_num_seqs * max_len * bytes_per_block // self.block_size)
        self.num_blocks = max(1, budget // bytes_per_block)
        self.kv_cache_bytes = self.num_blocks * bytes_per_block
        shape = (self.num_blocks * self.block_size, num_kv_heads, head_dim)
        self.kv_row = num_kv_heads * head_dim
        self.k_workspace = self.v_workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        # the one switch between attention paths: CUDA runs the Triton kernels, which read
        # the cache through the block tables; elsewhere the torch spans gather it
        self.paged_kernels = self.device.type == "cuda"
        for attn in self.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _kv_budget(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            return int(total * config.gpu_memory_utilization) - used_by_others
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(2 << 30, free_ram // 10)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Compute the batch; return logits (float32) of the sequences that reach their
        end this step, 1 + len(spec_token_ids) rows each, and their indices in the batch."""
        input_ids, positions, meta, sample_rows, sampled = self.prepare(batch)
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

    def prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        starts = [s.num_computed_tokens for s in batch.seqs]
        ends = [start + n for start, n in zip(starts, batch.num_new_tokens, strict=True)]
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = torch.tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        )
        ids: list[int] = []
        for seq, start, end in zip(batch.seqs, starts, ends, strict=True):
            ids.extend(seq.token_ids[start:end])
            ids.extend(seq.spec_token_ids)  # the scheduler kept only those it scheduled
        row_seq = torch.repeat_interleave(torch.tensor(batch.num_new_tokens))
        q_ends = torch.tensor(batch.num_new_tokens).cumsum(0)
        offsets = torch.tensor(starts) - (q_ends - torch.tensor(batch.num_new_tokens))
        positions = torch.arange(len(ids)) + offsets[row_seq]
        slot_mapping = tables[row_seq, positions // bs] * bs + positions % bs
        q_ends = q_ends.tolist()

        if self.paged_kernels:
            meta = self._paged_meta(batch, ends, q_ends, tables, slot_mapping)
        else:
            meta = self._span_meta(batch, ends, q_ends, starts, tables, slot_mapping)
        sampled = [
            i
            for i, (s, end) in enumerate(zip(batch.seqs, ends, strict=True))
            if end == len(s) + len(s.spec_token_ids)
        ]
        # a sequence verifying k proposed tokens samples at its last k + 1 positions
        sample_rows = torch.tensor(
            [
                row
                for i in sampled
                for row in range(q_ends[i] - 1 - len(batch.seqs[i].spec_token_ids), q_ends[i])
            ],
            dtype=torch.long,
            device=self.device,
        )
        input_ids = torch.tensor(ids, device=self.device)
        return input_ids, positions.to(self.device), meta, sample_rows, sampled

    def _span_meta(self, batch, ends, q_ends, starts, tables, slot_mapping) -> AttentionMetadata:
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
        device_tables = tables.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
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
                    start_pos=starts[i],
                    block_ids=device_tables[i, : -(-ends[i] // bs)],
                )
            )
        return meta

    def _paged_meta(self, batch, ends, q_ends, tables, slot_mapping) -> AttentionMetadata:
        """The Triton kernels' metadata: the block tables and lengths as they are."""
        device = self.device
        empty = torch.empty(0, dtype=self.dtype, device=device)
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_size=self.block_size,
            k_workspace=empty,  # nothing is gathered
            v_workspace=empty,
            paged=PagedBatch(
                block_tables=tables.to(device, torch.int32),
                context_lens=torch.tensor(ends, dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0, *q_ends], dtype=torch.int32, device=device),
                max_query_len=max(batch.num_new_tokens),
            ),
        )
