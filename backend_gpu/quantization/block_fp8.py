"""Block-wise FP8, as DeepSeek-V3 / R1 (and Qwen3's FP8 releases) publish their weights:
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], "activation_scheme": "dynamic"}, each quantized linear layer's `weight` in
float8_e4m3fn [out, in] beside a float32 `weight_scale_inv` [ceil(out / 128),
ceil(in / 128)], one scale a 128 x 128 tile (the last row and column of tiles partial).
Despite its name the scale multiplies: w = fp8 * weight_scale_inv (DeepSeek's
fp8_cast_bf16.py, transformers' FP8Linear). DeepSeek ships embeddings, the LM head,
norms and routers unquantized; which layers are quantized is read from the tensors
themselves (a weight with a scale beside it), so `modules_to_not_convert` (and
transformers' `modules_to_convert`) need no matching.

The engine widens each such weight as it streams in, tile by tile, to the model's dtype
(what transformers computes with on the dequantized weights): on the CPU the model is
then the 16-bit one, exactly. `quantization="fp8"` then holds it in the engine's FP8
layout (per output channel, requantized from the widened values). A weight is read
whole and cut for a tensor-parallel rank after widening (a rank's rows need not start
on a tile). A fused weight (Phi-3's qkv_proj, gate_up_proj: one tiling over the parts)
is widened whole, then split into its parts, each cut as a tensor of its name. A config
field this cannot honour is refused by name at start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from backend_gpu.tp_shards import SKIP, FusedParts, ShardRead

FP8 = torch.float8_e4m3fn
SCALE = "weight_scale_inv"
# what DeepSeek's config.json and transformers' FineGrainedFP8Config say
CONFIG_KEYS = ("quant_method", "fmt", "weight_block_size", "activation_scheme")
# which layers are quantized the tensors say (a weight with its scale), and the engine
# widens them whatever transformers is told (`dequantize`)
IGNORED_KEYS = ("modules_to_not_convert", "ignored_layers", "modules_to_convert", "dequantize")
# keys whose one value the engine reads: float32 scales (not DeepSeek-V4's E8M0 bytes),
# FP8 experts (not V4's FP4)
ONLY_VALUES = {"scale_fmt": "float", "expert_dtype": "fp8"}


def block_size_of(directory: str) -> tuple[int, int] | None:
    """The (rows, columns) tile of a block-wise FP8 checkpoint in `directory`; None where
    its config has no such quantization_config. ValueError names a field the engine
    cannot honour."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    if not quant or str(quant.get("quant_method", "")).lower() != "fp8":
        return None
    return check_config(quant)


def check_config(quant: dict) -> tuple[int, int]:
    """The tile of a `quant_method: fp8` config, or ValueError naming the first field
    the engine cannot honour."""
    for key in quant:
        if key not in CONFIG_KEYS + IGNORED_KEYS + tuple(ONLY_VALUES):
            raise ValueError(f"quantization_config.{key} is not supported for fp8 checkpoints")
    for key, value in ONLY_VALUES.items():
        if quant.get(key, value) != value:
            raise ValueError(
                f"quantization_config.{key} {quant[key]!r} is not supported (only {value!r})"
            )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":  # static input scales: tensors the engine would leave unread
        raise ValueError(
            f"quantization_config.activation_scheme {scheme!r} is not supported (only 'dynamic')"
        )
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size {block!r} is not supported "
            "(two positive integers: per-tensor or per-channel FP8 are compressed-tensors')"
        )
    return block[0], block[1]


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight [out, in] FP8 times its tile's scale, in `dtype` (computed in float32: an
    E4M3 value times a float32 scale is exact there)."""
    rows, cols = weight.shape
    tiles = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != tiles:
        raise ValueError(
            f"{SCALE} {tuple(scale_inv.shape)} for a {rows} x {cols} weight in "
            f"{block[0]} x {block[1]} tiles: expected {tiles}"
        )
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scale = scale.repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


Shards = Callable[[str], ShardRead | None]


class BlockFp8Checkpoint:
    """Widens a block-wise FP8 checkpoint's weights as they stream in: `reads` makes a
    quantized weight and its scale read whole, `weights` yields each weight widened and
    cut to this rank's part, in place of the two."""

    def __init__(
        self,
        block: tuple[int, int],
        dtype: torch.dtype,
        names: Iterable[str],
        fused: FusedParts | None = None,
    ) -> None:
        """`names`: the checkpoint's tensor names (as the stream will name them);
        `fused`: the model's fused tensors (the loader's FusedParts)."""
        self.block = block
        self.dtype = dtype
        self.quantized = {n[: -len(SCALE)] + "weight" for n in names if n.endswith(SCALE)}
        self.fused = fused

    def fused_reads(self, fused: FusedParts | None) -> FusedParts | None:
        """`fused` for the checkpoint's reads, except that an FP8 weight is read whole:
        `weights` splits it after widening."""
        if fused is None:
            return None
        return lambda name: None if name in self.quantized else fused(name)

    def _parts(self, whole: str, widened: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A fused weight's parts, rows in order (or the weight itself)."""
        parts = self.fused(whole) if self.fused is not None else None
        if not parts:
            return [(whole, widened)]
        out, start = [], 0
        for name, rows in parts:
            out.append((name, widened[start : start + rows]))
            start += rows
        return out

    @staticmethod
    def _weight_name(name: str) -> str:
        return name[: -len(SCALE)] + "weight" if name.endswith(SCALE) else name

    def reads(self, shards: Shards | None) -> Shards | None:
        """`shards` except that a weight and its scale are read whole (both, or neither
        where the rank holds none of the weight): they are cut after widening."""
        if shards is None:
            return None

        def read(name: str) -> ShardRead | None:
            whole = self._weight_name(name)
            if whole in self.quantized:
                return SKIP if shards(whole) is SKIP else None
            return shards(name)

        return read

    def weights(
        self, stream: Iterator[tuple[str, torch.Tensor]], shards: Shards | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`stream` with each FP8 weight and its scale replaced by the weight widened
        (and cut by `shards`); every other tensor as it is."""
        held: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in stream:
            whole = self._weight_name(name)
            if whole not in self.quantized:
                if tensor.dtype == FP8:
                    raise ValueError(f"{name}: FP8 in the checkpoint without its {SCALE}")
                yield name, tensor
                continue
            pair = held.setdefault(whole, {})
            pair[SCALE if name.endswith(SCALE) else "weight"] = tensor
            if len(pair) < 2:
                continue
            del held[whole]
            try:
                widened = dequantize(pair["weight"], pair[SCALE], self.block, self.dtype)
            except ValueError as e:
                raise ValueError(f"{whole}: {e}") from None
            for name, part in self._parts(whole, widened):
                read = shards(name) if shards is not None else None
                if read is not None:
                    part = part.narrow(read.dim, read.start, read.stop - read.start)
                    if read.rows is not None and part.shape[0] < read.rows:  # a token table's
                        part = F.pad(part, (0, 0, 0, read.rows - part.shape[0]))
                yield name, part
        if held:  # a scale whose weight never came (another stage's are never read)
            name = next(iter(held))
            raise ValueError(f"{name} is missing from the checkpoint beside its {SCALE}")
