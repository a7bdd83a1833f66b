"""Build our models and load weights from a Hugging Face directory of safetensors.

A model is built on the meta device (no memory, no random init), given uninitialized
memory on its device in its dtype, then every parameter is filled from the checkpoint
(or with random values, load_format "dummy"): no float32 copy is ever made and cast.
Checkpoint tensors keep their HF names; the ones our models pack into one matmul
(q/k/v, gate/up) are copied into their shard of the packed weight, and a checkpoint that
fuses them itself (Phi-3's qkv_proj) is read as its parts. A multimodal checkpoint's text
model (Gemma 3 4B-27B) is read under a text model's names, its vision tower only by a
model that serves images (reads_vision_tower).
Under tensor parallelism a rank reads only its part of each tensor (tp_shards.py):
safetensors slices are read from the file as such, so no rank ever holds the whole model.
A block-wise FP8 checkpoint (DeepSeek-V3's) is widened as it streams, a weight at a time
(quantization/block_fp8.py); other pre-quantized ones stay quantized (quantized_checkpoint.py).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.expert_shards import EXPERT_TENSOR, ExpertCheckpointShards, ExpertShard, MoEConfig
from backend_gpu.layers.linear import PackedLinear
from backend_gpu.layers.moe import FusedExperts
from backend_gpu.layers.rotary import RotaryEmbedding
from backend_gpu.models import model_class
from backend_gpu.models.llama import head_dim_of
from backend_gpu.pp_stages import WHOLE_MODEL, Stage, prune_to_stage
from backend_gpu.quantization.block_fp8 import BlockFp8Checkpoint, block_size_of
from backend_gpu.quantized_checkpoint import QuantizedCheckpoint, tensor_names
from backend_gpu.tp_shards import SKIP, CheckpointShards, FusedParts, ShardRead

# checkpoint module name -> (our packed module name, shard)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


# a multimodal checkpoint's text model, in the hub's layout and in transformers 5's
TEXT_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
VISION_PREFIXES += ("model.multi_modal_projector.",)


def text_model_name(name: str, vision: bool = False) -> str | None:
    """A checkpoint tensor's name in a text model; None for a vision tower's, unless
    `vision` (a model that reads its tower: Gemma 3's, which names them itself)."""
    if name.startswith(VISION_PREFIXES):
        return name if vision else None
    for prefix, ours in TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name


@dataclass(frozen=True)
class Checkpoint:
    """A directory of safetensors files, read one tensor (or one rank's part) at a time."""

    directory: str

    def tensors(
        self,
        shards: CheckpointShards | None = None,
        dropped: tuple[str, ...] = (),
        fused: FusedParts | None = None,
        vision: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs: whole, or what `shards` says this rank holds; tensors
        whose name starts with one of `dropped` (another pipeline stage's) are not read.
        Names are a text model's (text_model_name). `fused`: the parts of a tensor that
        holds several of ours, each read and cut as a tensor of its own. `vision`: the
        vision tower's tensors too, under their own names."""
        files = sorted(glob.glob(os.path.join(self.directory, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        for path in files:
            with safe_open(path, framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    name = text_model_name(stored, vision)
                    if name is None or name.startswith(dropped):
                        continue
                    if fused is not None and (parts := fused(name)) is not None:
                        yield from _read_parts(f.get_slice(stored), parts, shards)
                        continue
                    read = shards(name) if shards is not None else None
                    if read is None:
                        yield name, f.get_tensor(stored)
                    elif read is not SKIP:
                        yield name, _read_shard(f.get_slice(stored), read)


def _read_parts(tensor_slice, parts: list[tuple[str, int]], shards) -> Iterator:
    """A fused tensor's parts (rows [start, start + rows) each, in order), each cut as
    `shards` cuts a tensor of its name: fused tensors are column-parallel, cut by rows."""
    start = 0
    for name, rows in parts:
        read = shards(name) if shards is not None else None
        if read is not SKIP:
            assert read is None or read.dim == 0, (name, read)
            lo, hi = (0, rows) if read is None else (read.start, read.stop)
            yield name, tensor_slice[(slice(start + lo, start + hi),)]
        start += rows


def _read_shard(tensor_slice, read: ShardRead) -> torch.Tensor:
    index = (slice(None),) * read.dim + (slice(read.start, read.stop),)
    part = tensor_slice[index]
    if read.rows is not None and part.shape[0] < read.rows:  # the vocabulary's padding
        part = torch.cat([part, part.new_zeros(read.rows - part.shape[0], *part.shape[1:])])
    return part


def load_weights(model: nn.Module, weights) -> None:
    """Copy (name, tensor) pairs into `model`; every parameter must be set exactly once.
    A model with a `checkpoint_name(name)` says which parameter a checkpoint tensor
    fills (None: one it does not use)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    lm_head = getattr(model, "lm_head", None)  # embedding models have none
    # a later pipeline stage has no embedding table, an encoder (BERT) no `model`
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    # a quantized table is installed by the checkpoint's stream (quantized_checkpoint.py)
    tied = getattr(lm_head, "weight", None) is getattr(embed, "weight", False)
    missing = {n for n in params if not (n == "lm_head.weight" and tied)}
    for path, module in modules.items():  # experts load from one tensor per expert
        if isinstance(module, FusedExperts):
            missing -= {f"{path}.{name}" for name, _ in module.named_parameters()}
            missing.update(module.checkpoint_names(path))
    rename = getattr(model, "checkpoint_name", None)
    for name, tensor in weights:
        if name.startswith("model.language_model."):  # multimodal checkpoints' text tower
            name = "model." + name[len("model.language_model.") :]
        if rename is not None and (name := rename(name)) is None:
            continue
        if "rotary_emb" in name or (name == "lm_head.weight" and tied):
            continue
        expert = EXPERT_TENSOR.match(name)
        if expert is not None and isinstance(modules.get(expert.group(1)), FusedExperts):
            modules[expert.group(1)].load_expert(int(expert.group(2)), expert.group(3), tensor)
            missing.discard(name)
            continue
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in PACKED_MODULES:
            packed, shard = PACKED_MODULES[leaf]
            target = modules.get(f"{parent}.{packed}")
            if not isinstance(target, PackedLinear):
                raise ValueError(f"unexpected checkpoint tensor {name}")
            want = getattr(target, param_name)[target.shard_slices[shard]].shape
            if want != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model shape {tuple(want)}"
                )
            target.load_shard(param_name, shard, tensor)
            missing.discard(f"{parent}.{packed}.{param_name}")
            continue
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {name}")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                f"model shape {tuple(params[name].shape)}"
            )
        with torch.no_grad():
            params[name].copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} missing)")


def build_model(
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    checkpoint: Checkpoint,
    load_format: str,
    seed: int,
    tp: ParallelGroup = SINGLE,
    cls: type[nn.Module] | None = None,
    stage: Stage = WHOLE_MODEL,
    expert_parallel: bool = False,
    context_len: int | None = None,
) -> nn.Module:
    """The model of `hf_config` on `device` in `dtype` (tensor-parallel rank tp.rank's
    part of it), its parameters from `checkpoint`, or random for load_format "dummy".
    `cls`: the class to build, when not the generator of the config's architecture
    (an embedding model's). `stage`: the pipeline stage whose part alone is built and
    read (pp_stages.py). `expert_parallel`: a mixture of experts' ranks each hold whole
    experts (expert_shards.py). `context_len`: the positions the engine serves, for a model
    that computes by it (Phi-3's LongRoPE picks its factors by it: set_context_len)."""
    if cls is None:
        cls = model_class((hf_config.architectures or [hf_config.model_type])[0])
    moe = MoEConfig.of(hf_config)
    if expert_parallel and moe is None:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
    with torch.device("meta"):
        extra = {"expert_parallel": True} if expert_parallel else {}
        model = cls(hf_config, tp, **extra).to(dtype)
    dropped = prune_to_stage(model, stage) if stage.count > 1 else []
    fused = getattr(cls, "fused_checkpoint_tensors", None)  # Phi-3's qkv_proj, gate_up_proj
    fused = fused and fused(hf_config)
    # before the model gets memory: its quantized layers get none of 16 bits
    quantized = blocks = None
    # a model that reads its checkpoint's quantization itself (gpt-oss's MXFP4 experts)
    if load_format != "dummy" and not getattr(model, "reads_own_quantization", False):
        blocks = block_fp8_checkpoint(checkpoint.directory, dtype, fused)  # widened as read
        if blocks is None:
            quantized = QuantizedCheckpoint.of(
                model, hf_config, checkpoint.directory, PACKED_MODULES, tp, fused
            )
    # to_empty gives each module its own tensors: note which parameters are one
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            shared.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in shared.values():
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    if context_len is not None and hasattr(model, "set_context_len"):
        model.set_context_len(context_len)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.compute_tables()
    if load_format == "dummy":
        dummy_weights(model, seed + tp.rank)
    else:
        # one rank reads whole tensors (and an encoder's config has no KV heads to split)
        # a model cut otherwise than by Llama's heads names its own (DeepSeek's MLA)
        cut = getattr(cls, "checkpoint_shards", CheckpointShards)
        shards = cut(hf_config, head_dim_of(hf_config), tp) if tp.size > 1 else None
        if shards is not None and moe is not None:
            # experts stacked in one tensor (gpt-oss's) are cut by the model's own rule
            experts = getattr(cls, "expert_checkpoint_shards", ExpertCheckpointShards)
            shards = experts(moe, ExpertShard.of(moe, tp, expert_parallel), shards)
        by_rank = shards  # what a widened FP8 weight is cut to
        if quantized is not None:
            shards = quantized.reads(shards)
        if blocks is not None:
            shards = blocks.reads(shards)
        if quantized is not None or blocks is not None:  # a quantized fused tensor: whole
            fused = (quantized or blocks).fused_reads(fused)
        vision = getattr(cls, "reads_vision_tower", False)  # Gemma 3's tower and projector
        weights = checkpoint.tensors(shards, tuple(dropped), fused, vision)
        if hasattr(model, "checkpoint_weights"):  # a layout of its own (gpt-oss's experts)
            weights = model.checkpoint_weights(weights)
        if quantized is not None:
            weights = quantized.weights(weights, model, dtype, device)
        if blocks is not None:
            weights = blocks.weights(weights, by_rank)
        load_weights(model, weights)
    return model


def block_fp8_checkpoint(
    directory: str, dtype: torch.dtype, fused: FusedParts | None = None
) -> BlockFp8Checkpoint | None:
    """The widening of a block-wise FP8 checkpoint (DeepSeek-V3's); None for another."""
    block = block_size_of(directory)
    if block is None:
        return None
    names = (text_model_name(name) for name in tensor_names(directory))
    held = [name for name in names if name is not None]
    return BlockFp8Checkpoint(block, dtype, held, fused)


@torch.no_grad()
def dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights, normal(0, 0.02) as HF initializes; vectors (norm scales,
    biases) at 1, which keeps the activations at their usual size; packed bytes (MXFP4
    experts) by their module's fill_dummy."""
    generator = None
    for param in model.parameters():
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed)
        if not param.is_floating_point():
            continue
        if param.dim() > 1:
            param.normal_(0.0, 0.02, generator=generator)
        else:
            param.fill_(1.0)
    for module in model.modules():
        if hasattr(module, "fill_dummy"):
            module.fill_dummy(generator)


def open_model(path: str):
    """(hf_config, tokenizer, Checkpoint) of an HF directory or a GGUF file."""
    from transformers import AutoConfig, AutoTokenizer

    if path.endswith(".gguf"):
        from backend_gpu.gguf_loader import convert_gguf

        path = convert_gguf(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model {path!r} is neither a directory nor a .gguf file")
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return text_config_of(config), tokenizer, Checkpoint(path)


def text_config_of(config):
    """The config the engine's model is built from: a multimodal model's text config,
    served under the whole model's architecture; a vision model's (Qwen2.5-VL's) with
    its tower's config, its image tokens and its head's tying beside it."""
    hf_config = getattr(config, "text_config", None) or config
    if not hf_config.architectures:  # a multimodal model's text model: served by its name
        hf_config.architectures = config.architectures
    if hf_config is not config and getattr(config, "vision_config", None) is not None:
        hf_config.vision_config = config.vision_config
        for name in (
            "image_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "mm_tokens_per_image",  # Gemma 3's
            "boi_token_id",
            "eoi_token_id",
        ):
            if getattr(config, name, None) is not None:
                setattr(hf_config, name, getattr(config, name))
        if getattr(config, "tie_word_embeddings", False):
            hf_config.tie_word_embeddings = True
    return hf_config
