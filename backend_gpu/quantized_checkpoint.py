"""Loading a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors) into a model built
on the meta device, its quantized layers kept quantized.

Before the model gets memory, every linear layer the checkpoint holds quantized is
swapped for a placeholder with no parameters, so no 16-bit weight is ever allocated for
it. The checkpoint's tensor names (read from the safetensors headers, no data) say which
layers are quantized; they must agree with the quantization_config, and every tensor the
layer's layout needs must be there: a disagreement is an error at start naming the
tensor. While the weights stream in, a quantized layer's tensors are held back until
all of them (and, for a fused q/k/v or gate/up layer, all of its parts) have arrived,
converted (checkpoint_tensors.py), cut to this rank's part (packed_shards.py: each
module is read whole, one at a time, and cut after conversion, since the layouts pack
along different dimensions), and the placeholder is replaced by the final layer:
PackedWeightLinear for INT4/INT8 in groups, QuantizedLinear for FP8 and INT8 per channel.
Every other tensor goes on to the ordinary loader.

A checkpoint that fuses a layer's parts in one tensor (Phi-3's qkv_proj and gate_up_proj,
quantized so by its quantizer: one scale per tensor covers all three of q, k and v) is
one checkpoint module feeding our fused layer whole: it is converted as one, and a
tensor-parallel rank cuts each part's rows (the model's fused_checkpoint_tensors says
which) out of it and joins them.

A token table (the embedding, the LM head) quantized to packed INT4/INT8 is one
PackedWeightLinear: the LM head as it is, the embedding through PackedEmbedding, which
dequantizes only the rows it looks up. A tied table is held once for both roles, as
the checkpoint holds it once: in a small model it is most of the bytes (Gemma 3 270M's
is 63 % of its weights), so without it an INT4 checkpoint would keep most of its
16-bit bytes.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from backend_gpu.distributed import ParallelGroup
from backend_gpu.layers.linear import PackedLinear, QuantizedLinear
from backend_gpu.layers.packed_weight_linear import PackedEmbedding, PackedWeightLinear
from backend_gpu.models.llama import head_dim_of
from backend_gpu.quantization.checkpoint_config import (
    CheckpointQuantization,
    WeightScheme,
    read_checkpoint_quantization,
)
from backend_gpu.quantization.checkpoint_tensors import (
    MARKERS,
    EightBitWeight,
    convert_module,
    expected_tensors,
)
from backend_gpu.quantization.packed import PackedWeight
from backend_gpu.quantization.packed_shards import (
    cut_columns,
    cut_parts,
    cut_rows,
    join_columns,
    pad_columns,
)
from backend_gpu.tp_shards import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    CheckpointShards,
    FusedParts,
    ShardRead,
)

LINEAR_LEAVES = COLUMN_PARALLEL + ROW_PARALLEL
# the token table's two roles, named alike in checkpoints and in our models
EMBEDDING, HEAD = "model.embed_tokens", "lm_head"
PACKED_LAYOUTS = ("gptq", "awq", "pack-quantized")


def tensor_names(directory: str) -> list[str]:
    """Every tensor name in the directory's safetensors files, from their headers."""
    names = []
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def model_name(model: nn.Module, name: str) -> str | None:
    """What load_weights calls checkpoint tensor `name` in `model` (None: unused)."""
    if name.startswith("model.language_model."):  # multimodal checkpoints' text tower
        name = "model." + name[len("model.language_model.") :]
    rename = getattr(model, "checkpoint_name", None)
    return name if rename is None else rename(name)


def checkpoint_shape(hf_config, leaf: str) -> tuple[int, int]:
    """(out, in) of checkpoint linear `leaf` in the whole (unsharded) model."""
    hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
    if leaf in ("embed_tokens", "lm_head"):
        return hf_config.vocab_size, hidden
    q = hf_config.num_attention_heads * head_dim
    kv = hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[leaf]


class AwaitingWeights(nn.Module):
    """Holds a quantized layer's place in the meta model until its tensors are read: it
    has no parameters, so giving the model memory allocates no weight for it."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.has_bias = getattr(original, "bias", None) is not None
        self.shard_slices: dict[str, slice] = getattr(original, "shard_slices", {})


@dataclass
class Part:
    """One checkpoint module feeding one of our layers (a fused layer has several)."""

    module: str  # its name in the checkpoint
    scheme: WeightScheme
    shape: tuple[int, int]  # (out, in), whole
    names: set[str]  # its tensors' names after the module's
    # a fused checkpoint module's parts (module name, rows), in row order; [] unfused
    splits: list[tuple[str, int]] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    weight: PackedWeight | EightBitWeight | None = None
    bias: torch.Tensor | None = None


@dataclass
class Layer:
    path: str  # ours
    placeholder: AwaitingWeights
    parts: list[Part]
    # a token table: which of model.embed_tokens and lm_head it becomes (both: tied)
    table_roles: tuple[str, ...] = ()


class QuantizedCheckpoint:
    """Swaps `model`'s quantized layers for placeholders (call before it gets memory);
    then `weights` filters the checkpoint's stream, installing those layers."""

    @classmethod
    def of(
        cls,
        model: nn.Module,
        hf_config,
        directory: str,
        packed_modules: dict[str, tuple[str, str]],
        tp: ParallelGroup,
        fused: FusedParts | None = None,
    ) -> QuantizedCheckpoint | None:
        """None where the checkpoint in `directory` is not pre-quantized. `fused`: the
        model's fused checkpoint tensors (the loader's)."""
        quant = read_checkpoint_quantization(directory)
        if quant is None:
            return None
        names = tensor_names(directory)
        return cls(model, hf_config, quant, names, packed_modules, tp, fused)

    def __init__(
        self,
        model: nn.Module,
        hf_config,
        quant: CheckpointQuantization,
        names: Iterable[str],
        packed_modules: dict[str, tuple[str, str]],
        tp: ParallelGroup,
        fused: FusedParts | None = None,
    ) -> None:
        self.quant = quant
        self.rank = tp.rank
        self.shards = (
            CheckpointShards(hf_config, head_dim_of(hf_config), tp) if tp.size > 1 else None
        )
        by_module: dict[str, set[str]] = {}
        for name in names:
            module, _, tensor = name.rpartition(".")
            by_module.setdefault(module, set()).add(tensor)
        self.layers: dict[str, Layer] = {}
        modules = dict(model.named_modules())
        for module, tensors in by_module.items():
            ours = model_name(model, f"{module}.weight")
            quantized = any(m in tensors for m in MARKERS)
            leaf = module.rpartition(".")[2]
            if ours is not None and ours.rpartition(".")[0] in (EMBEDDING, HEAD):
                scheme = self.quant.scheme_for(module)
                if quantized and scheme is not None and scheme.layout not in PACKED_LAYOUTS:
                    raise ValueError(
                        f"{module}: a token table quantized as {scheme.layout!r}; the engine "
                        "loads a quantized table packed (INT4/INT8 in groups: GPTQ, AWQ, "
                        "pack-quantized)"
                    )
                self._check_agreement(module, tensors, quantized)
                if quantized:
                    self._add_table(model, hf_config, module, scheme, tensors, modules)
                continue
            splits = _fused_splits(fused, module)
            if splits:  # a fused checkpoint tensor: its parts' layers say what it is
                leaf = _leaf(splits[0][0])
            if leaf not in LINEAR_LEAVES or ".experts." in module:
                if quantized:
                    raise ValueError(
                        f"{module}: quantized, which is not supported (only the decoder "
                        "layers' dense linear layers, q/k/v/o and gate/up/down, and the "
                        "token table)"
                    )
                continue
            self._check_agreement(module, tensors, quantized)
            if not quantized or ours is None:
                continue
            parent, _, _ = ours.rpartition(".")[0].rpartition(".")
            path, shard = (
                (f"{parent}.{packed_modules[leaf][0]}", packed_modules[leaf][1])
                if leaf in packed_modules
                else (ours.rpartition(".")[0], None)
            )
            target = modules.get(path)
            if target is None:  # not this model's (another pipeline stage's layer)
                continue
            layer = self.layers.get(path)
            if layer is None:
                layer = self.layers[path] = Layer(path, AwaitingWeights(target), [])
            scheme = quant.scheme_for(module)
            shape = checkpoint_shape(hf_config, leaf)
            if splits:
                shape = (sum(rows for _, rows in splits), shape[1])
            layer.parts.append(Part(module, scheme, shape, tensors, splits))
            if shard is not None and not splits:  # the fused layer's parts in its shard order
                order = list(layer.placeholder.shard_slices)
                layer.parts.sort(key=lambda p: order.index(packed_modules[_leaf(p.module)][1]))
        for layer in self.layers.values():
            self._swap(model, layer, modules[layer.path])
        self.part_of = {
            f"{part.module}.{name}": (layer, part)
            for layer in self.layers.values()
            for part in layer.parts
            for name in part.names
        }

    def _add_table(
        self, model, hf_config, module: str, scheme: WeightScheme, tensors: set[str], modules
    ) -> None:
        """A quantized token table: placeholders for the roles this model (or pipeline
        stage) holds, both of them where the embeddings are tied."""
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = getattr(model, "lm_head", None)
        if embed is not None and head is not None:
            tied = getattr(head, "weight", None) is getattr(embed, "weight", False)
        else:  # a pipeline stage may hold one of them
            tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        ours = model_name(model, f"{module}.weight").rpartition(".")[0]
        roles = (EMBEDDING, HEAD) if tied else (ours,)
        roles = tuple(r for r in roles if modules.get(r) is not None)
        if any(
            layer.table_roles and set(layer.table_roles) & set(roles)
            for layer in self.layers.values()
        ):
            raise ValueError(f"{module}: a second copy of a token table the model ties")
        if not roles:
            return
        part = Part(module, scheme, checkpoint_shape(hf_config, HEAD), tensors)
        self.layers[roles[0]] = Layer(roles[0], AwaitingWeights(modules[roles[0]]), [part], roles)

    def _check_agreement(self, module: str, tensors: set[str], quantized: bool) -> None:
        scheme = self.quant.scheme_for(module)
        method = self.quant.method
        if scheme is None and quantized:
            marker = next(m for m in MARKERS if m in tensors)
            raise ValueError(
                f"{module}.{marker}: quantized in the checkpoint, but its {method} "
                "quantization_config leaves it unquantized"
            )
        if scheme is not None and not quantized:
            raise ValueError(
                f"{module}.weight: unquantized in the checkpoint, but its {method} "
                "quantization_config quantizes it"
            )
        if scheme is None:
            return
        required, optional = expected_tensors(scheme)
        missing = sorted(required - tensors)
        if missing:
            raise ValueError(
                f"{module}.{missing[0]} is missing from the checkpoint: its {method} "
                f"quantization_config ({scheme.layout}, {scheme.bits} bits) needs it"
            )
        unexpected = sorted(tensors - required - optional - {"bias"})
        if unexpected:
            raise ValueError(
                f"{module}.{unexpected[0]}: not a tensor of a {method} {scheme.layout} layer"
            )

    def _swap(self, model: nn.Module, layer: Layer, target: nn.Module) -> None:
        fused = isinstance(target, PackedLinear)
        held = sum(len(p.splits) or 1 for p in layer.parts)
        if fused and held != len(target.shard_slices):
            raise ValueError(
                f"{', '.join(p.module for p in layer.parts)}: quantized in the checkpoint, "
                "but not the other parts of the layer the engine fuses them into"
            )
        for path in layer.table_roles or (layer.path,):
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer.placeholder)

    def reads(self, shards: CheckpointShards | None) -> Callable[[str], ShardRead | None] | None:
        """`shards` for Checkpoint.tensors, except that a quantized layer's tensors are
        read whole (its layout packs along either dimension): cut after conversion."""
        if shards is None:
            return None
        return lambda name: None if name in self.part_of else shards(name)

    def fused_reads(self, fused: FusedParts | None) -> FusedParts | None:
        """`fused` for Checkpoint.tensors, except that a quantized fused tensor is read
        whole: its layer converts it and cuts its parts (_convert)."""
        if fused is None:
            return None
        return lambda name: None if name in self.part_of else fused(name)

    def weights(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        model: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`stream` less the quantized layers' tensors, which install those layers in
        `model` as they complete."""
        for name, tensor in stream:
            held = self.part_of.get(name)
            if held is None:
                yield name, tensor
                continue
            layer, part = held
            part.tensors[name.rpartition(".")[2]] = tensor
            if len(part.tensors) == len(part.names):
                self._convert(part)
            if all(p.weight is not None for p in layer.parts):
                self._install(model, layer, dtype, device)
        waiting = [layer.path for layer in self.layers.values() if layer.parts[0].names]
        if waiting:
            raise ValueError(f"the checkpoint's stream ended before {waiting[:3]} were read")

    def _convert(self, part: Part) -> None:
        bias = part.tensors.pop("bias", None)
        out_features, in_features = part.shape
        weight = convert_module(part.module, part.scheme, part.tensors, out_features, in_features)
        read = self.shards(f"{part.module}.weight") if self.shards is not None else None
        if part.splits and self.shards is not None:  # each part's rows, joined again
            ranges = self._fused_ranges(part)
            weight = cut_parts(weight, ranges, [name for name, _ in part.splits])
            bias = None if bias is None else torch.cat([bias[lo:hi] for lo, hi in ranges])
        elif read is not None and read.dim == 0:
            weight = cut_columns(weight, read.start, read.stop)
            bias = None if bias is None else bias[read.start : read.stop]
            if read.rows is not None:  # a token table's last rank: the vocabulary's padding
                weight = pad_columns(weight, read.rows)
        elif read is not None:  # row-parallel: the bias is rank 0's (its placeholder's)
            weight = cut_rows(weight, read.start, read.stop, part.module)
        part.weight, part.bias, part.tensors = weight, bias, {}

    def _fused_ranges(self, part: Part) -> list[tuple[int, int]]:
        """This rank's rows [lo, hi) of each of a fused module's parts (column-parallel)."""
        assert self.shards is not None
        ranges, start = [], 0
        for name, rows in part.splits:
            read = self.shards(f"{name}.weight")
            assert read is not None and read.dim == 0, (name, read)
            ranges.append((start + read.start, start + read.stop))
            start += rows
        return ranges

    def _install(self, model: nn.Module, layer: Layer, dtype, device) -> None:
        names = [p.module for p in layer.parts]
        weights = [p.weight for p in layer.parts]
        weight = weights[0] if len(weights) == 1 else join_columns(weights, names)
        bias = None
        if layer.placeholder.has_bias:
            if any(p.bias is None for p in layer.parts):
                raise ValueError(f"{names[0]}.bias is missing from the checkpoint")
            bias = nn.Parameter(
                torch.cat([p.bias for p in layer.parts]).to(device, dtype), requires_grad=False
            )
        elif self.rank == 0:  # quantizers write zero biases; a real one the model lacks
            for part in layer.parts:  # (a row-parallel bias is rank 0's alone)
                if part.bias is not None and bool(part.bias.any()):
                    raise ValueError(f"{part.module}.bias: the model has no bias there")
        slices = layer.placeholder.shard_slices
        if isinstance(weight, PackedWeight):
            on_device = {
                f.name: getattr(weight, f.name).to(device)
                for f in dataclasses.fields(weight)
                if isinstance(getattr(weight, f.name), torch.Tensor)
            }
            weight = dataclasses.replace(weight, **on_device)
            final = PackedWeightLinear(weight, bias, dtype, slices, bool(layer.table_roles))
        else:
            w, scale = weight.weight.to(device), weight.scale.to(device)
            final = QuantizedLinear(w, scale, bias, weight.method, dtype, slices)
        for path in layer.table_roles or (layer.path,):
            parent, _, leaf = path.rpartition(".")
            role = PackedEmbedding(final) if path == EMBEDDING else final
            setattr(model.get_submodule(parent), leaf, role)
        for part in layer.parts:
            part.names, part.weight = set(), None  # done: its memory goes with the layer


def _fused_splits(fused: FusedParts | None, module: str) -> list[tuple[str, int]]:
    """Checkpoint module `module`'s parts (module name, rows) where the model reads it
    as a fused tensor; [] for another."""
    parts = fused(f"{module}.weight") if fused is not None else None
    return [(name.rpartition(".")[0], rows) for name, rows in parts or ()]


def _leaf(module: str) -> str:
    return module.rpartition(".")[2]
