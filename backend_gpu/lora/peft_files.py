"""A LoRA adapter's files in PEFT's format, read and checked against the base model.

PEFT writes `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, the target
modules, ...) and `adapter_model.safetensors` with one A [r, in] and one B [out, r]
per adapted module, named `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`.
What the engine cannot apply exactly as PEFT does (DoRA, extra trained modules, biases,
embedding or LM head targets, per-module ranks) is refused with a BadRequestError that
names it (Phi-3's fused qkv_proj and gate_up_proj are applied as their parts, which is
exactly what the engine holds), before anything is loaded: a half-applied adapter would be a silently wrong
model. `inspect` reads only the config and the safetensors header (cheap: it runs in
add_request); `read` then loads the tensors (in a background thread). Neither file is
trusted: the config and the header are read only up to a size no real adapter comes
near (a huge one is refused by its size, not parsed), and a file that is not what it
says (random bytes, cut short) is refused naming it, as is a tensor `read` finds other
than `inspect` saw (the file changed in between).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from engine_api.errors import BadRequestError
from engine_api.records import AdapterRef

# the projections an adapter may target: PEFT's module name -> the engine's packed
# module and the name of its column range there (None: the module is not packed)
PROJECTIONS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", None),
}
# a checkpoint's own fused projection (Phi-3's) -> its parts in row order: PEFT adapts it
# as one module (A [r, in], B [sum of the parts' out, r]), which is the parts each with
# that A and its rows of B, as the engine holds them
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_MODEL_TYPES = ("phi3",)  # whose transformers model has those modules (Phi-3, Phi-4)
_GROUP = {
    proj: "self_attn" if packed in ("qkv_proj", "o_proj") else "mlp"
    for proj, (packed, _) in PROJECTIONS.items()
} | {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
_PREFIX = "base_model.model.model.layers"
_KEY = re.compile(
    rf"{re.escape(_PREFIX)}\.(\d+)\."
    rf"({'|'.join(re.escape(f'{g}.{p}') for p, g in _GROUP.items())})\.lora_([AB])\.weight"
)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT writes a config of about a kilobyte, and a header of ~150 bytes a tensor (a rank-64
# adapter of every projection of a 128-layer model: under 200 KB)
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
# what safetensors raises for a file that is not one (random bytes, cut short, a key
# missing) besides the OS's errors
_UNREADABLE = (OSError, ValueError, RuntimeError, SafetensorError)


@dataclass(frozen=True)
class BaseShapes:
    """The base model's adaptable projections: (in, out) features of each, unsharded."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # a fused base's fused projections too

    @classmethod
    def of(cls, hf_config) -> BaseShapes:
        h, inter = hf_config.hidden_size, hf_config.intermediate_size
        head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
        q = hf_config.num_attention_heads * head_dim
        kv = hf_config.num_key_value_heads * head_dim
        features = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        features |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        if getattr(hf_config, "model_type", None) in FUSED_MODEL_TYPES:
            features |= {
                fused: (h, sum(features[p][1] for p in parts)) for fused, parts in FUSED.items()
            }
        return cls(hf_config.num_hidden_layers, features)


@dataclass
class AdapterInfo:
    """What the config and the header say: enough to accept or refuse the adapter."""

    ref: AdapterRef
    rank: int
    scale: float  # alpha / r, or alpha / sqrt(r) under rsLoRA, as PEFT computes it
    modules: list[tuple[int, str]]  # (layer, projection) pairs it adapts


@dataclass
class AdapterWeights:
    """An adapter in host memory: A [r, in] and B [out, r] per (layer, projection)."""

    info: AdapterInfo
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def _refuse(ref: AdapterRef, problem: str) -> BadRequestError:
    return BadRequestError(f"adapter {ref.name!r} ({ref.path}): {problem}")


def _read_config(ref: AdapterRef) -> dict:
    if not os.path.isdir(ref.path):
        raise _refuse(ref, "no such directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(ref.path, name)):
            raise _refuse(ref, f"no {name}: not a PEFT LoRA adapter directory")
    try:
        with open(os.path.join(ref.path, CONFIG_FILE), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise _refuse(ref, f"{CONFIG_FILE} is not readable ({exc.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise _refuse(ref, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes: not a PEFT config")
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise _refuse(ref, f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse(ref, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(ref: AdapterRef, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale), or the first unsupported setting refused."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(ref, f"peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    for flag, what in (("use_dora", "DoRA (use_dora)"), ("lora_bias", "lora_bias")):
        if config.get(flag):
            raise _refuse(ref, f"{what} is not supported")
    if config.get("modules_to_save"):
        raise _refuse(ref, f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(ref, f"bias {config['bias']!r} is not supported (only 'none')")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise _refuse(ref, f"{pattern} (a rank or alpha per module) is not supported")
    if config.get("fan_in_fan_out"):
        raise _refuse(ref, "fan_in_fan_out is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        # a module's name, or its path (PEFT writes "all-linear" out as the paths)
        known = (*PROJECTIONS, *FUSED)
        unknown = sorted(t for t in targets if str(t).rpartition(".")[2] not in known)
        if unknown:
            raise _refuse(
                ref, f"target modules {unknown} are not supported; supported: {list(known)}"
            )
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _refuse(ref, f"r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise _refuse(ref, f"rank {rank} is above max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise _refuse(ref, f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def _check_header_size(ref: AdapterRef, path: str) -> None:
    """Refuse a safetensors file whose header (JSON, parsed whole by safetensors) is past
    MAX_HEADER_BYTES, or that is too short to have one."""
    with open(path, "rb") as f:
        prefix = f.read(8)
    if len(prefix) < 8:
        raise _refuse(ref, f"{WEIGHTS_FILE} is cut short: not a safetensors file")
    (size,) = struct.unpack("<Q", prefix)
    if size > MAX_HEADER_BYTES:
        raise _refuse(
            ref, f"{WEIGHTS_FILE}'s header is over {MAX_HEADER_BYTES} bytes: not a LoRA adapter"
        )


def inspect(ref: AdapterRef, shapes: BaseShapes, max_rank: int) -> AdapterInfo:
    """Check `ref`'s config and tensor shapes against the base model without reading
    the tensors; BadRequestError names the first problem."""
    rank, scale = _check_config(ref, _read_config(ref), max_rank)
    path = os.path.join(ref.path, WEIGHTS_FILE)
    try:
        _check_header_size(ref, path)
        with safe_open(path, framework="pt") as f:
            header = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except BadRequestError:
        raise
    except _UNREADABLE as exc:
        raise _refuse(ref, f"{WEIGHTS_FILE} is not readable ({exc})") from None
    halves: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, shape in header.items():
        match = _KEY.fullmatch(key)
        if match is None and ("embed" in key or "lm_head" in key):
            raise _refuse(ref, f"tensor {key!r}: embedding and LM head targets are not supported")
        if match is None:
            known = [*PROJECTIONS, *FUSED]
            raise _refuse(ref, f"tensor {key!r} is not a LoRA A or B of {known}")
        layer, proj, half = int(match[1]), match[2].split(".")[1], match[3]
        halves.setdefault((layer, proj), {})[half] = shape
    if not halves:
        raise _refuse(ref, f"{WEIGHTS_FILE} holds no LoRA tensors")
    for layer, proj in sorted(halves):
        both = [p for p in FUSED.get(proj, ()) if (layer, p) in halves]
        if both:
            raise _refuse(
                ref, f"layer {layer} {proj}: adapted both fused and as its part {both[0]}"
            )
    for (layer, proj), pair in sorted(halves.items()):
        where = f"layer {layer} {proj}"
        if layer >= shapes.num_layers:
            raise _refuse(ref, f"{where}: the base model has {shapes.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise _refuse(ref, f"{where}: lora_A or lora_B is missing")
        if proj not in shapes.features:
            raise _refuse(
                ref,
                f"{where}: the base model has no fused {proj} (its checkpoint holds "
                f"{', '.join(FUSED[proj])} apart): an adapter for another model?",
            )
        fan_in, fan_out = shapes.features[proj]
        if pair["A"] != [rank, fan_in] or pair["B"] != [fan_out, rank]:
            raise _refuse(
                ref,
                f"{where}: A {pair['A']} and B {pair['B']} do not fit the base model "
                f"(A [{rank}, {fan_in}], B [{fan_out}, {rank}]): an adapter for another model?",
            )
    return AdapterInfo(ref, rank, scale, sorted(halves))


def read(info: AdapterInfo, shapes: BaseShapes) -> AdapterWeights:
    """The tensors `inspect` accepted, in host memory (their stored dtype); a
    BadRequestError if the file is no longer what `inspect` saw."""
    ref, path = info.ref, os.path.join(info.ref.path, WEIGHTS_FILE)
    tensors = {}
    try:
        with safe_open(path, framework="pt") as f:
            for layer, proj in info.modules:
                stem = f"{_PREFIX}.{layer}.{_GROUP[proj]}.{proj}"
                a, b = f.get_tensor(f"{stem}.lora_A.weight"), f.get_tensor(f"{stem}.lora_B.weight")
                fan_in, fan_out = shapes.features[proj]
                if list(a.shape) != [info.rank, fan_in] or list(b.shape) != [fan_out, info.rank]:
                    raise _refuse(ref, f"{WEIGHTS_FILE} changed while it was read")
                start = 0
                for part in FUSED.get(proj, (proj,)):  # a fused one: its parts' rows of B
                    rows = shapes.features[part][1]
                    tensors[layer, part] = (a, b[start : start + rows])
                    start += rows
    except BadRequestError:
        raise
    except _UNREADABLE as exc:
        raise _refuse(ref, f"{WEIGHTS_FILE} is not readable ({exc})") from None
    return AdapterWeights(info, tensors)
