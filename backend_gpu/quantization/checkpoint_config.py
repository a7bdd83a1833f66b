"""What a pre-quantized checkpoint's `quantization_config` (in its config.json) says, read
once at start: which layout each quantized layer's tensors are in, at how many bits, in
which groups. GPTQ's and AWQ's configs are small dicts of well-known keys; the
compressed-tensors one is read through that library's own config classes, so its
schemes, presets and aliases mean what llm-compressor meant by them.

Anything else with a quantization_config (bitsandbytes, EXL2, HQQ, Marlin-only exports,
...) is refused here, before a weight is read: loading it as if it were unquantized
would give a model that runs and talks nonsense.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from backend_gpu.quantization.packed import SUPPORTED_BITS

SUPPORTED = (
    "gptq (4 or 8 bits, any group size, desc_act, checkpoint_format gptq or gptq_v2), "
    "awq (4 bits, version gemm, with zero points), compressed-tensors (pack-quantized "
    "W4A16/W8A16 in groups or channels, float-quantized FP8 weights per channel or "
    "tensor, int-quantized W8A8 per channel or tensor), fp8 in blocks (DeepSeek-V3's "
    "weight_block_size, widened as loaded: quantization/block_fp8.py)"
)


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a way the engine does not load."""

    def __init__(self, what: str) -> None:
        super().__init__(f"checkpoint quantization {what} is not supported; supported: {SUPPORTED}")


@dataclass(frozen=True)
class WeightScheme:
    """How one quantized layer's tensors are laid out in the checkpoint."""

    # "gptq" | "awq" | "pack-quantized" (-> PackedWeight), "float-quantized" (-> FP8) or
    # "int-quantized" (-> INT8), both 8-bit with a scale per output channel
    layout: str
    bits: int
    group_size: int = -1  # -1: one group per output channel (the whole input)
    symmetric: bool = True
    act_order: bool = False  # a g_idx tensor gives each input row's group
    gptq_v1_zeros: bool = False  # GPTQ v1 stores zero - 1 (AutoGPTQ's convention)
    static_inputs: bool = False  # an input_scale (and zero point) per layer


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization: (targets, scheme) groups, the first match wins;
    `ignore`d modules are unquantized."""

    method: str  # quant_method, for messages
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of checkpoint module `module` (dotted name); None: unquantized."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(target, module) for target in targets):
                return scheme
        return None


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target rules: a class name ("Linear", or "Embedding", which
    of the modules quantized checkpoints hold only the token embedding is), a regular
    expression ("re:..."), or the module's name or last part."""
    if target in ("Linear", "Embedding"):
        return (target == "Embedding") == (module.rpartition(".")[2] == "embed_tokens")
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def read_checkpoint_quantization(directory: str) -> CheckpointQuantization | None:
    """The quantization of the checkpoint in `directory` (None: not pre-quantized)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    quant = config.get("quantization_config")
    if quant is None:
        text = config.get("text_config") or {}
        quant = text.get("quantization_config")
    if quant is None:
        return None
    method = str(quant.get("quant_method", "unknown")).lower()
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise UnsupportedQuantization(repr(method))


def _bits(method: str, bits) -> int:
    if bits not in SUPPORTED_BITS:
        raise UnsupportedQuantization(f"{method} with {bits} bits")
    return bits


def _gptq(quant: dict) -> CheckpointQuantization:
    """AutoGPTQ's and GPTQModel's config keys. checkpoint_format "gptq" (v1) stores each
    zero point less one; GPTQModel's "gptq_v2" stores it as it is."""
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2") or quant.get("is_marlin_format"):
        raise UnsupportedQuantization(f"gptq with checkpoint_format {fmt!r}")
    if quant.get("dynamic"):
        raise UnsupportedQuantization("gptq with per-module overrides ('dynamic')")
    if quant.get("pack_dtype", "int32") != "int32":
        raise UnsupportedQuantization(f"gptq packed in {quant['pack_dtype']}")
    scheme = WeightScheme(
        layout="gptq",
        bits=_bits("gptq", quant.get("bits")),
        group_size=int(quant.get("group_size", -1)),
        symmetric=bool(quant.get("sym", True)),
        act_order=bool(quant.get("desc_act", False)),
        gptq_v1_zeros=fmt == "gptq",
    )
    ignore = () if quant.get("lm_head") else ("lm_head",)  # GPTQModel's flag for the head
    return CheckpointQuantization("gptq", ((("Linear",), scheme),), ignore)


def _awq(quant: dict) -> CheckpointQuantization:
    """transformers' AwqConfig keys, as AutoAWQ writes them to config.json."""
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedQuantization(f"awq version {version!r}")
    if not quant.get("zero_point", True):
        raise UnsupportedQuantization("awq without zero points")
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise UnsupportedQuantization(f"awq with {bits} bits")
    group_size = int(quant.get("group_size", quant.get("q_group_size", -1)))
    scheme = WeightScheme(layout="awq", bits=4, group_size=group_size, symmetric=False)
    # AutoAWQ quantizes the decoder's linear layers, never the head
    ignore = ("lm_head", *(quant.get("modules_to_not_convert") or ()))
    return CheckpointQuantization("awq", ((("Linear",), scheme),), ignore)


def _compressed_tensors(quant: dict) -> CheckpointQuantization:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from pydantic import ValidationError

    if quant.get("sparsity_config"):
        raise UnsupportedQuantization("compressed-tensors with a sparsity_config")
    if quant.get("transform_config"):
        raise UnsupportedQuantization("compressed-tensors with a transform_config")
    try:
        config = QuantizationConfig.model_validate(
            {k: v for k, v in quant.items() if k not in ("sparsity_config", "transform_config")}
        )
    except ValidationError as e:  # e.g. actorder "group" (g_idx), which 0.20 removed
        errors = "; ".join(err["msg"] for err in e.errors())
        raise UnsupportedQuantization(f"compressed-tensors config ({errors})") from None
    if config.quantization_status != QuantizationStatus.COMPRESSED:
        raise UnsupportedQuantization(
            f"compressed-tensors with quantization_status {config.quantization_status.value!r}"
        )
    if config.kv_cache_scheme is not None:
        raise UnsupportedQuantization(
            "compressed-tensors with a kv_cache_scheme (the engine calibrates its own FP8 "
            "KV cache: kv_cache_dtype 'fp8')"
        )
    groups = []
    for name, scheme in config.config_groups.items():
        fmt = scheme.format or config.format
        groups.append((tuple(scheme.targets), _compressed_scheme(name, fmt, scheme)))
    return CheckpointQuantization("compressed-tensors", tuple(groups), tuple(config.ignore or ()))


def _compressed_scheme(name: str, fmt: str, scheme) -> WeightScheme:
    """One config group of a compressed-tensors config as a WeightScheme. Its actorder
    can only be "weight" (0.20 removed "group"): the weights are reordered while
    quantizing, the groups stay in order, so no g_idx."""
    weights, inputs = scheme.weights, scheme.input_activations
    what = f"compressed-tensors {fmt!r} (config group {name!r})"
    if weights is None or scheme.output_activations is not None:
        raise UnsupportedQuantization(f"{what} without weights or with output activations")
    strategy = weights.strategy
    if fmt == "pack-quantized":
        if weights.type != "int" or strategy not in ("group", "channel") or inputs is not None:
            raise UnsupportedQuantization(
                f"{what} with {weights.type} weights by {strategy}"
                + (" and quantized activations" if inputs is not None else "")
            )
        return WeightScheme(
            layout=fmt,
            bits=_bits(what, weights.num_bits),
            group_size=weights.group_size if strategy == "group" else -1,
            symmetric=weights.symmetric,
        )
    wanted = {"float-quantized": "float", "int-quantized": "int"}.get(fmt)
    if (
        wanted is None
        or weights.type != wanted
        or weights.num_bits != 8
        or strategy not in ("channel", "tensor")
        or not weights.symmetric
    ):
        raise UnsupportedQuantization(
            f"{what} with {weights.num_bits}-bit {weights.type} weights by {strategy}"
            + ("" if weights.symmetric else ", asymmetric")
        )
    return WeightScheme(
        layout=fmt,
        bits=8,
        static_inputs=inputs is not None and not inputs.dynamic,
    )
