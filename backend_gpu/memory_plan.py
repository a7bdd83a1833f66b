"""What a model needs of a GPU before it is loaded, for `kvgate plan`: weight bytes in
each format the engine serves, KV bytes per token, and the KV blocks, concurrent
sequences and smallest tensor-parallel size that a device leaves room for.

Every sum is the engine's own (memory.py, which the engine's memory profile calls);
only the inputs the engine measures are computed here instead: the weights are the
engine's model classes built on the meta device (no memory, exact shapes; the 8-bit
formats the layout quantize_model gives them), the activations' peak and the CUDA
context are estimates. INT4 (GPTQ/AWQ layout) is sized by arithmetic: packed 4-bit
weights of the decoder's linear layers and experts plus a 16-bit scale and a 4-bit zero
per group of inputs, the embeddings, norms and LM head kept in 16 bits, as such
checkpoints ship them; the 8-bit formats store the token table in 8 bits, so where the
table is most of a model (Gemma 3 270M: 63 % of its parameters) INT4 is the larger, and
the plan says so (and what a checkpoint with its table INT4 too would take).

Its inputs are checked in plan_inputs.py, which imports no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from backend_gpu.config import EngineConfig
from backend_gpu.distributed import ParallelGroup
from backend_gpu.gguf_loader import cache_root, file_digest
from backend_gpu.image_processing import Qwen2VLImageProcessor
from backend_gpu.layers.gpt_oss_moe import Mxfp4Experts
from backend_gpu.layers.linear import TABLE_GROUP
from backend_gpu.layers.moe import FusedExperts
from backend_gpu.loader import text_config_of
from backend_gpu.memory import (
    KVCacheSize,
    device_kv_budget,
    encoder_batch_bytes,
    encoder_cache_bytes,
    full_heads_kv_bytes_per_token,
    graph_batch,
    graph_pool_bytes,
    kv_cache_size,
    kv_shape_of,
    logit_rows,
    parameter_bytes,
    siglip_batch_bytes,
    step_activation_bytes,
    step_shape_of,
)
from backend_gpu.models import model_class
from backend_gpu.plan_inputs import (
    DTYPE_BYTES,
    KV_ITEMSIZE,
    PlanDevice,
    PlanSettings,
    check_model_path,
)
from backend_gpu.quantization.block_fp8 import check_config
from backend_gpu.quantization.mxfp4 import without_quantization
from backend_gpu.tp_shards import check_divisible

WEIGHT_FORMATS = ("16-bit", "fp8", "int8", "int4")
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class RankPlan:
    """One rank's memory at one tensor-parallel size."""

    tp_size: int
    weight_bytes: int
    activation_bytes: int
    graph_pool_bytes: int
    kv: KVCacheSize
    max_concurrent_seqs: int  # sequences of max_model_len tokens the blocks hold

    @property
    def fits(self) -> bool:
        return self.kv.num_blocks >= self.kv.blocks_per_seq


@dataclass
class MemoryPlan:
    model: str
    architecture: str
    device: PlanDevice
    settings: PlanSettings
    max_model_len: int
    parameters: int
    weight_bytes: dict[str, int]  # format -> bytes of the whole model (one rank at TP 1)
    # int4 keeps them 16-bit (as GPTQ/AWQ checkpoints ship them), fp8 and int8 do not:
    # where they are most of a model, int4 is the larger
    token_table_parameters: int
    int4_packed_table_bytes: int  # int4 with the token tables packed too
    kv_bytes_per_token: dict[str, int]  # kv_cache_dtype -> bytes, the whole model
    sliding_window: int | None
    sliding_layers: int
    num_layers: int
    kv_bytes_per_seq_windowed: int  # a window-aware cache's bytes for one full sequence
    ranks: list[RankPlan] = field(default_factory=list)
    # experts the checkpoint ships packed (gpt-oss's MXFP4): their bytes so, and in 16 bits
    expert_bytes: dict[str, int] = field(default_factory=dict)
    # multi-head latent attention (DeepSeek-V3): what full heads' keys and values would
    # take a token in the chosen KV dtype, against kv_bytes_per_token's one latent row
    full_heads_kv_bytes_per_token: int = 0
    # a block-wise FP8 checkpoint's (DeepSeek-V3's) tile, rows x columns: the engine
    # widens it as it loads, so it holds weight_bytes[dtype], or ["fp8"] quantized
    fp8_tiles: tuple[int, int] | None = None

    @property
    def chosen(self) -> RankPlan | None:
        """The smallest tensor-parallel size that holds one sequence of max_model_len."""
        return next((r for r in self.ranks if r.fits), None)


def load_model_config(path: str):
    """The text model's transformers config of an HF directory, a GGUF file or a bare
    config.json (no weights read)."""
    check_model_path(path)  # before transformers, which imports torch
    from transformers import AutoConfig

    if path.endswith(".gguf"):
        converted = os.path.join(cache_root(), "gguf", file_digest(path))
        if os.path.isfile(os.path.join(converted, "config.json")):
            # the engine converted it already: its config, without parsing the GGUF's
            # metadata again (a large vocabulary's arrays take a minute)
            config = AutoConfig.from_pretrained(converted)
        else:
            directory, name = os.path.split(os.path.abspath(path))
            config = AutoConfig.from_pretrained(directory, gguf_file=name)
            if config.model_type == "gemma3_text":  # as backend_gpu.gguf_loader converts it
                config.architectures = ["Gemma3ForCausalLM"]
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            config = AutoConfig.for_model(**json.load(f))
    else:
        config = AutoConfig.from_pretrained(path)
    return text_config_of(config)


def meta_model(hf_config, dtype: str, tp_size: int) -> nn.Module:
    """Rank 0's part of the engine's model of `hf_config` on the meta device (under
    tensor parallelism a vision model that can serves its text alone: Gemma 3's)."""
    cls = model_class((hf_config.architectures or [hf_config.model_type])[0])
    if tp_size > 1 and getattr(cls, "text_model", None):
        cls = model_class(cls.text_model)
    with torch.device("meta"):
        return cls(hf_config, ParallelGroup(rank=0, size=tp_size)).to(getattr(torch, dtype))


def format_bytes(model: nn.Module, fmt: str, dtype_bytes: int, group_size: int) -> int:
    """Bytes of a (meta) model's weights in format `fmt` (WEIGHT_FORMATS)."""
    if fmt in ("fp8", "int8"):
        return eight_bit_bytes(model)
    if fmt == "int4":
        return int4_bytes(model, dtype_bytes, group_size)
    return parameter_bytes(model)


def decoder_matrices(model: nn.Module) -> Iterator[tuple[nn.Parameter, int, int]]:
    """The weights a quantization method packs: every linear layer's of the decoder
    layers and every expert's (a mixture of experts' [experts, rows, cols]), each as
    (parameter, rows, cols); the rows of all experts together."""
    for module in model.model.layers.modules():
        if isinstance(module, nn.Linear):
            yield module.weight, *module.weight.shape
        elif isinstance(module, FusedExperts):
            for weight in (module.gate_up_proj, module.down_proj):
                yield weight, weight.shape[0] * weight.shape[1], weight.shape[2]


def token_tables(model: nn.Module) -> list[nn.Parameter]:
    """The token table and an untied LM head's (a tied one is the same parameter)."""
    tables = {id(model.model.embed_tokens.weight): model.model.embed_tokens.weight}
    tables[id(model.lm_head.weight)] = model.lm_head.weight
    return list(tables.values())


def eight_bit_bytes(model: nn.Module) -> int:
    """What quantize_model leaves (its shapes; running it on the meta device takes a
    minute for a 7B model): every linear layer's and expert's weight in 8 bits with a
    float32 scale per output row, the token table (and an untied LM head's) in INT8
    with a float32 scale per TABLE_GROUP values; norms, biases and routers as they are."""
    total = parameter_bytes(model)
    for table in token_tables(model):
        total -= table.numel() * table.element_size()
        total += table.numel() + table.numel() // TABLE_GROUP * 4
    for weight, rows, cols in decoder_matrices(model):
        total += rows * cols + rows * 4 - weight.numel() * weight.element_size()
    return total


def int4_bytes(model: nn.Module, dtype_bytes: int, group_size: int) -> int:
    """The decoder layers' linear and expert weights in 4 bits with a 16-bit scale and
    a 4-bit zero per `group_size` inputs of a row (GPTQ's and AWQ's layout); the rest
    as it is."""
    total = parameter_bytes(model)
    for weight, rows, cols in decoder_matrices(model):
        total += packed_int4_bytes(rows, cols, group_size) - weight.numel() * dtype_bytes
    return total


def int4_packed_table_bytes(model: nn.Module, dtype_bytes: int, group_size: int) -> int:
    """int4_bytes with the token tables packed in 4 bits too, as a checkpoint that
    quantizes them holds them (quantized_checkpoint.py serves it)."""
    total = int4_bytes(model, dtype_bytes, group_size)
    for table in token_tables(model):
        rows, cols = table.shape
        total += packed_int4_bytes(rows, cols, group_size) - table.numel() * dtype_bytes
    return total


def packed_int4_bytes(rows: int, cols: int, group_size: int) -> int:
    """A [rows, cols] matrix in 4 bits, a 16-bit scale and a 4-bit zero per group."""
    groups = -(-cols // group_size)
    return rows * cols // 2 + rows * groups * 2 + -(-rows * groups // 2)


def windowed_seq_bytes(hf_config, bytes_per_token: int, length: int) -> tuple[int | None, int, int]:
    """(window, sliding layers, bytes of one `length`-token sequence in a cache that
    keeps only the window of sliding layers). kvgate's cache keeps every layer in full."""
    from backend_gpu.models.llama import sliding_window_of

    layers = hf_config.num_hidden_layers
    windows = [sliding_window_of(hf_config, i) for i in range(layers)]
    sliding = [w for w in windows if w]
    per_layer = bytes_per_token // layers
    tokens = sum(min(w, length) if w else length for w in windows)
    return (max(sliding) if sliding else None), len(sliding), per_layer * tokens


def plan_rank(
    hf_config, device: PlanDevice, s: PlanSettings, tp_size: int, length: int
) -> RankPlan:
    """One rank's plan at `tp_size`: the engine's budget sums on computed inputs."""
    dtype_bytes = DTYPE_BYTES[s.dtype]
    model = meta_model(hf_config, s.dtype, tp_size)
    weights = format_bytes(model, s.quantization or "16-bit", dtype_bytes, s.int4_group_size)
    step = step_shape_of(hf_config, tp_size, dtype_bytes)
    activations = step_activation_bytes(
        step, s.max_num_batched_tokens, logit_rows(s.max_num_seqs, s.max_num_batched_tokens)
    )
    if getattr(model, "vision", False):
        activations += vision_bytes(hf_config, dtype_bytes)
    graphs = 0 if s.enforce_eager else graph_batch(s.max_num_seqs, s.max_num_batched_tokens)
    pool = graph_pool_bytes(step, graphs)
    budget = s.kv_cache_memory_bytes
    if budget is None:
        in_use = device.in_use_bytes + weights
        budget = device_kv_budget(
            device.total_bytes, s.gpu_memory_utilization, in_use, activations, pool
        )
    itemsize = KV_ITEMSIZE[s.kv_cache_dtype] or dtype_bytes
    kv = kv_cache_size(kv_shape_of(hf_config, tp_size, itemsize), s.block_size, budget, length)
    return RankPlan(tp_size, weights, activations, pool, kv, kv.num_blocks // kv.blocks_per_seq)


def vision_bytes(hf_config, dtype_bytes: int) -> int:
    """A vision model's share beside its weights (the tower's are in the model): one
    image at the processor's default limit through the tower, and the encoder cache at
    the engine's default bound; 0 for a text model."""
    cls = model_class((hf_config.architectures or [hf_config.model_type])[0])
    if not getattr(cls, "vision", False):
        return 0
    tower = hf_config.vision_config
    if getattr(cls, "mrope", False):  # Qwen2.5-VL: the processor's largest image
        _, h, w = Qwen2VLImageProcessor().largest_grid()
        batch = encoder_batch_bytes(tower, h * w, dtype_bytes)
    else:  # Gemma 3: every image one square
        tokens = getattr(hf_config, "mm_tokens_per_image", 256)
        batch = siglip_batch_bytes(tower, tokens, hf_config.hidden_size, dtype_bytes)
    cached = EngineConfig.encoder_cache_tokens
    return batch + encoder_cache_bytes(cached, hf_config.hidden_size, dtype_bytes)


def plan_memory(path: str, device: PlanDevice, settings: PlanSettings) -> MemoryPlan:
    """The plan of the model at `path` on `device` under `settings`."""
    hf_config = load_model_config(path)
    dtype = settings.dtype
    max_positions = hf_config.max_position_embeddings
    length = min(settings.max_model_len or max_positions, max_positions)  # context_len's
    model = meta_model(hf_config, dtype, 1)
    dtype_bytes, group_size = DTYPE_BYTES[dtype], settings.int4_group_size
    # experts shipped packed (gpt-oss's MXFP4, which the engine keeps so): the formats
    # are the 16-bit model's, the checkpoint's own beside them
    packed = [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
    whole = meta_model(without_quantization(hf_config), dtype, 1) if packed else model
    formats = {
        dtype if fmt == "16-bit" else fmt: format_bytes(whole, fmt, dtype_bytes, group_size)
        for fmt in WEIGHT_FORMATS
    }
    expert_bytes = {}
    if packed:
        formats["mxfp4"] = parameter_bytes(model)
        experts = [m.mlp.experts for m in whole.model.layers]
        expert_bytes = {"mxfp4": sum(map(parameter_bytes, packed))}
        expert_bytes[dtype] = sum(map(parameter_bytes, experts))
    per_token = {
        kv_dtype: kv_shape_of(hf_config, 1, size or DTYPE_BYTES[dtype]).bytes_per_token
        for kv_dtype, size in KV_ITEMSIZE.items()
    }
    chosen_per_token = per_token[settings.kv_cache_dtype]
    window, sliding, windowed = windowed_seq_bytes(hf_config, chosen_per_token, length)
    sizes = [settings.tensor_parallel_size] if settings.tensor_parallel_size else TP_SIZES
    ranks = []
    for size in sizes:
        try:
            check_divisible(hf_config, size)
            # and the model's own rules (MXFP4 experts are cut in whole groups)
            ranks.append(plan_rank(hf_config, device, settings, size, length))
        except ValueError:
            if settings.tensor_parallel_size:
                raise
    return MemoryPlan(
        model=path,
        architecture=(hf_config.architectures or [hf_config.model_type])[0],
        device=device,
        settings=settings,
        max_model_len=length,
        parameters=sum(p.numel() for p in whole.parameters()),
        weight_bytes=formats,
        token_table_parameters=sum(t.numel() for t in token_tables(model)),
        int4_packed_table_bytes=int4_packed_table_bytes(whole, dtype_bytes, group_size),
        kv_bytes_per_token=per_token,
        sliding_window=window,
        sliding_layers=sliding,
        num_layers=hf_config.num_hidden_layers,
        kv_bytes_per_seq_windowed=windowed,
        ranks=ranks,
        expert_bytes=expert_bytes,
        full_heads_kv_bytes_per_token=full_heads_kv_bytes_per_token(
            hf_config, KV_ITEMSIZE[settings.kv_cache_dtype] or dtype_bytes
        ),
        fp8_tiles=fp8_tiles_of(hf_config),
    )


def fp8_tiles_of(hf_config) -> tuple[int, int] | None:
    """The tile of a block-wise FP8 checkpoint's config (block_fp8.py); None otherwise."""
    quant = getattr(hf_config, "quantization_config", None)
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "fp8":
        return None
    return check_config(quant)
