"""Runs the model on a scheduled batch: owns the weights and the paged KV cache and
turns the batch into flat token ids, positions, slot mapping and context slots, in
buffers allocated once (step_buffers.py); on CUDA, decodes replay CUDA graphs
(cuda_graphs.py).

The KV cache takes what is left once the weights are loaded: kv_budget.py decides how
many blocks (profiling the activations on CUDA), the runner allocates them.

Under tensor parallelism every rank has a runner over its part of the model
(tp_shards.py) and of the KV cache (its KV heads, the same block ids on every rank).
Rank 0's runner builds each step's rows from the scheduled sequences (rank_handoff.py)
and hands them to the other ranks (tp_ranks.py) before running them itself; the others
run what they are handed (execute). The ranks agree at start on the number of blocks
(the least any rank's memory holds) and on the FP8 cache's scales (those of the whole
layer).
Under pipeline parallelism a runner holds one stage's layers and their KV cache
(pp_stages.py); pp_runner.py runs the stages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from backend_gpu.config import EngineConfig
from backend_gpu.cuda_graphs import DecodeGraphs, capture_sizes
from backend_gpu.distributed import SINGLE, ParallelGroup, rank_device
from backend_gpu.kv_budget import KVSizing
from backend_gpu.layers.cpu_packed import pack_for_cpu
from backend_gpu.loader import Checkpoint, build_model
from backend_gpu.lora import AdapterWeights, BaseShapes, LoRAStacks
from backend_gpu.memory import (
    encoder_cache_bytes,
    graph_batch,
    kv_shape_of,
    logit_rows,
    parameter_bytes,
)
from backend_gpu.models.llama import head_dim_of
from backend_gpu.multimodal import VisionSteps, image_markers, image_processor
from backend_gpu.pp_stages import WHOLE_MODEL, Stage
from backend_gpu.prompt_logprobs import (
    PromptLogprobs,
    prompt_targets,
    row_slices,
    score_prompt_rows,
)
from backend_gpu.quantization import KV_CACHE_DTYPES
from backend_gpu.quantization.fp8 import FP8, check_fp8_kv_cache
from backend_gpu.quantization.kv_calibration import calibrate_kv_scales, calibration_token_ids
from backend_gpu.quantization.model import quantize_model
from backend_gpu.rank_handoff import LoRASlot, OtherRanks, StepRows, step_rows
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.span_metadata import span_metadata
from backend_gpu.spec_decode.aux_states import AuxStates
from backend_gpu.spec_decode.eagle3_config import aux_layers_of
from backend_gpu.step_buffers import Capacity, StepBuffers
from backend_gpu.tp_shards import CheckpointShards

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepOutput:
    """What a step computed, on rank 0 (None elsewhere)."""

    logits: torch.Tensor | None  # [rows, vocab] float32, the sampled sequences' rows
    sampled: list[int]  # the sampled sequences' indices in the batch
    prompt_logprobs: PromptLogprobs | None  # what the batch's prompt spans score


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        checkpoint: Checkpoint,
        tokenizer,
        tp: ParallelGroup = SINGLE,
        ranks: OtherRanks | None = None,  # rank 0's handle on the others, under TP
        stage: Stage = WHOLE_MODEL,  # its pipeline stage (pp_stages.py)
        world: ParallelGroup | None = None,  # every rank of every stage; None: tp's
        model_cls: type[nn.Module] | None = None,  # when not the config's architecture
    ) -> None:
        self.tp = tp
        self.ranks = ranks
        self.stage = stage
        self.world = world or tp
        self.device = rank_device(config.device, self.world.rank)
        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or DTYPES[config.dtype]
        if self.kv_dtype == FP8:  # before the weights load
            check_fp8_kv_cache(self.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.model = build_model(
            hf_config,
            self.dtype,
            self.device,
            checkpoint,
            config.load_format,
            config.seed,
            tp,
            stage=stage,
            cls=model_cls,
            expert_parallel=config.enable_expert_parallel,
            context_len=config.context_len(hf_config),
        )
        if config.quantization is not None:
            quantize_model(self.model, config.quantization, tp)
        self.model.eval()
        self.weight_bytes = parameter_bytes(self.model)
        # counted above: the packed weights replace the stacked ones, bytes for bytes
        pack_for_cpu(self.model)
        self.hf_config = hf_config
        # a vision model's image inputs, through the encoder cache (rank 0's: TP refused)
        self.vision = (
            VisionSteps(
                self.model,
                image_processor(self.model, checkpoint.directory, config.resize_image_pixels),
                config.encoder_cache_tokens,
                image_markers(self.model, hf_config, tokenizer),
            )
            if getattr(self.model, "vision", False)
            else None
        )
        # an EAGLE-3 head reads a few layers' inputs: kept on rank 0 from every step
        # (graphs included, so before the memory profile and the graphs)
        self.aux_states = (
            AuxStates.install(self.model, aux_layers_of(config, hf_config), hf_config.hidden_size)
            if tp.rank == 0 and stage.count == 1
            else None
        )
        # only its stage's layers: the KV cache of a layer lives on its stage
        layers = self.model.model.layers[stage.start : stage.stop]
        self.attention_layers = [layer.self_attn for layer in layers]
        self.max_model_len = config.context_len(hf_config)
        self.hidden_size = hf_config.hidden_size
        kv = kv_shape_of(hf_config, tp.size, self.kv_dtype.itemsize)
        self.kv_shape = (kv.kv_heads, kv.head_dim)
        self.kv_tensors = kv.tensors  # 1: MLA's one row per token, no V cache
        self.kv_row = self.kv_shape[0] * self.kv_shape[1]
        if self.kv_dtype == FP8:  # before the cache exists: calibration uses scratch rows
            calibrate_kv_scales(
                self.model,
                self.attention_layers,
                calibration_token_ids(tokenizer, self.max_model_len),
                self.kv_shape,
                self.dtype,
                self.device,
                tp,
            )
        # LoRA adapters' slots, before the memory profile and the graphs: both run them
        self.lora: LoRAStacks | None = None
        if config.enable_lora:
            if not getattr(self.model, "supports_lora", True):  # its projections are others
                raise ValueError(
                    f"enable_lora: LoRA adapters on {type(self.model).__name__} are not supported"
                )
            self.lora = LoRAStacks(
                self.model,
                BaseShapes.of(hf_config),
                config.max_loras,
                config.max_lora_rank,
                config.max_num_batched_tokens,
                self.dtype,
                self.device,
                CheckpointShards(hf_config, head_dim_of(hf_config), tp) if tp.size > 1 else None,
            )
        # the one switch between attention paths: CUDA runs the Triton kernels, which read
        # the cache through the block tables; elsewhere the torch spans gather it
        self.paged_kernels = self.device.type == "cuda"
        # rows of vocabulary-wide logits a step holds at once: what it samples (a row per
        # seat), or a slice of prompt logprobs; the memory profile measures this many
        self.logit_rows = logit_rows(config.max_num_seqs, config.max_num_batched_tokens)
        capacity = Capacity(
            tokens=config.max_num_batched_tokens,
            # under VTC one seat beyond max_num_seqs (scheduler.py); each has a token
            seqs=min(config.max_num_seqs + 1, config.max_num_batched_tokens),
            width=-(-self.max_model_len // self.block_size),
        )
        self.buffers = StepBuffers(capacity, self.device)
        # a pipeline stage runs eagerly (its input is the previous stage's hidden states)
        self.use_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and stage.count == 1
        )
        self.graph_max_seqs = graph_batch(config.max_num_seqs, config.max_num_batched_tokens)
        self._allocate_kv_cache(config)
        self.k_workspace = self.v_workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0  # decode steps that replayed a graph
        if self.use_graphs:
            self._capture_graphs()

    def _allocate_kv_cache(self, config: EngineConfig) -> None:
        size = KVSizing(
            config=config,
            hf_config=self.hf_config,
            model=self.model,
            stage=self.stage,
            attention_layers=self.attention_layers,
            device=self.device,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            kv_shape=self.kv_shape,
            kv_tensors=self.kv_tensors,
            max_model_len=self.max_model_len,
            logit_rows=self.logit_rows,
            weight_bytes=self.weight_bytes,
            tp_size=self.tp.size,
            graph_seqs=self.graph_max_seqs if self.use_graphs else 0,
            vision_grid=self.vision.processor.largest_grid() if self.vision else None,
            encoder_cache_bytes=encoder_cache_bytes(
                config.encoder_cache_tokens, self.hidden_size, self.dtype.itemsize
            )
            if self.vision
            else 0,
        ).size(self.world)
        self.num_blocks = size.num_blocks
        self.kv_cache_bytes = size.cache_bytes
        # one block more, which the block manager never hands out: CUDA graphs pad
        # decodes with sequences that write their key and value there
        self.scratch_slot = self.num_blocks * self.block_size
        shape = ((self.num_blocks + 1) * self.block_size, *self.kv_shape)
        for attn in self.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                if self.kv_tensors == 2
                else attn.k_cache[:0]  # MLA: its one row is keys and values both
            )

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
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Compute the batch (on every rank); rank 0 gets the logits (float32) of the
        sequences that reach their end this step, 1 + len(spec_token_ids) rows each, their
        indices in the batch, and the logprobs its prompt spans score (None without)."""
        # a vision model's M-RoPE positions, image rows and rows that see ahead
        # (backend_gpu.multimodal): 1D positions (shifted) where every row is text, else
        # [3, T]; a step with image rows runs eagerly (the graphs embed token ids only:
        # an image's last token can be a one-row chunk, at plain positions on Gemma 3)
        vision = self.vision.step(batch) if self.vision is not None else None
        rope = vision.positions if vision is not None else None
        flat = rope is None or bool((rope[0] == rope[1]).all() and (rope[0] == rope[2]).all())
        text = vision is None or vision.images is None
        graph_size = None
        if self.graphs is not None and max(batch.num_new_tokens) == 1 and flat and text:
            graph_size = self.graphs.size_for(len(batch.seqs))
        spans = batch.prompt_spans
        prompt_rows = row_slices(spans, self.logit_rows)  # prepare hands them to the ranks
        targets = None
        if spans:
            ids, top_n = prompt_targets(batch.seqs, spans)
            targets = (torch.tensor(ids, device=self.device), top_n)
        try:
            shifted = {"rope_positions": rope[0]} if rope is not None else {}
            ahead = {"key_last": vision.key_last} if vision is not None else {}
            input_ids, positions, *inputs, sampled = self.prepare(
                batch, graph_size, prompt_rows, **shifted, **ahead
            )
            if not flat:
                positions = torch.from_numpy(rope).to(self.device)
            if vision is not None:
                self.model.step_images = vision.images
            logits, scored = self._forward(
                input_ids, positions, *inputs, graph_size, prompt_rows, targets
            )
        except RuntimeError as exc:
            if self.ranks is None:
                raise
            raise self.ranks.failure(exc) from exc  # a collective failed: which rank is gone
        finally:
            if self.vision is not None:
                self.model.step_images = None
        prompt = PromptLogprobs(spans, *scored) if scored is not None else None
        return StepOutput(logits, sampled, prompt)

    @torch.inference_mode()
    def execute(self, step: StepRows) -> None:
        """Ranks other than 0: run the step rank 0 handed over (its logits go to rank 0)."""
        graph_size = step.padded_seqs if step.graph else None
        self._forward(*self.load(step), graph_size, step.prompt_rows, None)

    def _forward(
        self,
        input_ids,
        positions,
        meta,
        sample_rows,
        graph_size: int | None,
        prompt_rows: list[tuple[int, int]],
        targets: tuple[torch.Tensor, int] | None,
    ):
        """The model over the step, then the LM head: over the prompt rows (a slice at a
        time, score_prompt_rows), then over the sampled rows. Every rank runs all of it
        (the logits' gather is collective); rank 0 returns the sampled rows' float32
        logits and the prompt rows' (chosen, top values, top ids), the others (None, None)."""
        if graph_size is not None:
            hidden = self.graphs.replay(graph_size)
            self.num_graph_steps += 1
        else:
            hidden = self.model(input_ids, positions, meta)
        return self.head(hidden, sample_rows, prompt_rows, targets)

    def head(
        self,
        hidden: torch.Tensor,
        sample_rows: torch.Tensor,
        prompt_rows: list[tuple[int, int]],
        targets: tuple[torch.Tensor, int] | None,
    ):
        """The LM head over the prompt rows, then over the sampled rows (_forward's)."""
        scored = score_prompt_rows(self.model.compute_logits, hidden, prompt_rows, targets)
        logits = self.model.compute_logits(hidden[sample_rows])
        return (None if logits is None else logits.float()), scored

    def write_lora(self, slot: int, weights: AdapterWeights | None) -> None:
        """Put an adapter in LoRA slot `slot` (None: clear it), between steps; rank 0
        hands it to the other ranks first."""
        assert self.lora is not None
        if self.ranks is not None:
            self.ranks.send(LoRASlot(slot, weights))
        self.lora.write(slot, weights)

    def check_alive(self) -> None:
        """Raise EngineDeadError if another tensor-parallel rank has exited."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for a single rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for `num_blocks` gathered blocks of K and of V, reused across steps
        (fresh big allocations each layer would cost page faults)."""
        needed = num_blocks * self.block_size * self.kv_row
        if self.k_workspace.numel() < needed:
            self.k_workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
            self.v_workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
        return self.k_workspace, self.v_workspace

    def prepare(
        self,
        batch: ScheduledBatch,
        graph_size: int | None,
        prompt_rows: list[tuple[int, int]],
        rope_positions=None,
        key_last=None,
    ):
        """Build the step's rows, hand them to the other ranks, fill this rank's step
        buffers; return (input ids, positions, attention metadata, sampled rows, sampled
        sequences' indices). With `graph_size` (a decode batch) the buffers are padded
        to that many sequences for the graph of that size. `prompt_rows`, the slices of
        the batch's prompt spans, go to the other ranks too: they run the LM head on them
        as well. `rope_positions`: the rows' rotary positions where they are not their
        indices (an M-RoPE model's, shifted by an image's delta); `key_last`: per row,
        the last key it sees where some see ahead (a Gemma 3 image's tokens)."""
        step, sampled = step_rows(
            batch, graph_size, prompt_rows, self.scratch_slot, self.lora is not None
        )
        step.rope_positions = rope_positions
        step.key_last = key_last
        if self.ranks is not None:
            self.ranks.send(step)
        return (*self.load(step), sampled)

    def load(self, step: StepRows):
        """Fill the step buffers with `step`; return (input ids, positions, attention
        metadata, sampled rows)."""
        num_seqs = step.padded_seqs
        num_tokens = num_seqs if step.graph else len(step.token_ids)
        self._reserve(Capacity(num_tokens, num_seqs, max(map(len, step.tables))))
        buffers = self.buffers
        buffers.begin()
        buffers.fill(step, self.block_size)
        buffers.upload(num_tokens, len(step.sample_rows), num_seqs)
        if self.lora is not None:
            self.lora.set_step(step.lora_slots, step.num_new)
        dev = buffers.dev
        if self.paged_kernels:
            meta = buffers.paged_metadata(num_tokens, num_seqs, max(step.num_new), self.block_size)
        else:
            meta = span_metadata(
                step,
                self.block_size,
                dev["block_tables"],
                dev["slot_mapping"][:num_tokens],
                self._workspace,
                getattr(self.model, "decode_groups_on_one_thread", False),
            )
        if step.key_last is not None:  # a step with image rows that see ahead: rare, small
            meta.key_last = torch.from_numpy(step.key_last).to(self.device)
        return (
            dev["input_ids"][:num_tokens],
            dev["positions"][:num_tokens],
            meta,
            dev["sample_rows"][: len(step.sample_rows)],
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
