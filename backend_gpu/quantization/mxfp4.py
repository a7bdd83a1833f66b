"""MXFP4 (the OCP Microscaling format's FP4), as gpt-oss's published checkpoints keep
their experts: each run of 32 values along a row's inputs is 32 E2M1 codes (sign, two
exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two
to a byte, low nibble first (`*_blocks`, uint8 [..., rows, groups, 16]), and one shared
power of two, an E8M0 byte holding exponent + 127 (`*_scales`, uint8 [..., rows,
groups]). 4.25 bits a value: 0.27x of bfloat16.

The engine keeps them so (models/gpt_oss.py): the CPU path widens one expert at a time
(`dequantize`), the CUDA path decodes the codes in the Triton grouped GEMM's registers
(layers/triton_mxfp4.py). What a checkpoint's `quantization_config` may say is checked
here (`check_config`): a field it cannot honour is refused by name.
"""

from __future__ import annotations

import copy
import fnmatch
import functools

import torch

GROUP = 32  # values that share one scale
BYTES_PER_GROUP = GROUP // 2
SCALE_BIAS = 127  # E8M0: 2 ** (byte - 127)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are negated
# the keys a gpt-oss checkpoint's quantization_config has (transformers' Mxfp4Config)
CONFIG_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")
EXPERTS_MODULE = "model.layers.0.mlp.experts"  # what modules_to_not_convert must not name


@functools.cache
def _table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256 * 256]: at scale byte * 256 + block byte, the two values that block byte
    holds under that scale (the low nibble's first) in `dtype`, as one integer word of
    their bits (512 KiB in float32: it stays in a core's cache)."""
    codes = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)
    pairs = torch.stack([codes.repeat(16), codes.repeat_interleave(16)], dim=1)
    powers = torch.exp2(torch.arange(256, dtype=torch.float32) - SCALE_BIAS)
    values = (powers.view(256, 1, 1) * pairs).to(dtype)  # a code times a power of two
    word = {2: torch.int32, 4: torch.int64}[values.element_size()]
    return values.view(word).view(-1).to(device)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, groups * 32] in `dtype` of blocks [..., rows, groups, 16] and scales
    [..., rows, groups]; a code times its power of two is exact in any float dtype (as
    transformers' ldexp, for the scales checkpoints hold). One lookup a byte in a table
    of every (scale, byte) pair's two values as one word, in `dtype`: no multiply nor
    cast after it (faster on a CPU than a byte's lookup, a scale's multiply and a cast:
    PERF.md, "gpt-oss decode: the experts' step"). Other dtypes go through float32."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return dequantize(blocks, scales, torch.float32).to(dtype)
    index = (scales.to(torch.int32) << 8).unsqueeze(-1) + blocks  # int32 [..., groups, 16]
    values = _table(blocks.device, dtype).index_select(0, index.view(-1)).view(dtype)
    return values.view(*scales.shape[:-1], -1)


def packed_shapes(experts: int, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of `experts` matrices [rows, cols] in MXFP4."""
    if cols % GROUP:
        raise ValueError(f"MXFP4 packs rows of whole groups of {GROUP}; {cols} is not one")
    return (experts, rows, cols // GROUP, BYTES_PER_GROUP), (experts, rows, cols // GROUP)


def is_mxfp4(hf_config) -> bool:
    """Whether the config's checkpoint keeps its experts in MXFP4 (checked: check_config)."""
    quant = getattr(hf_config, "quantization_config", None)
    return bool(quant) and _get(quant, "quant_method") == "mxfp4"


def check_config(quant) -> None:
    """Raise ValueError naming the first field of a gpt-oss `quantization_config` the
    engine cannot honour: another method, an unknown key, or the experts left unconverted
    (the other modules a checkpoint lists are 16-bit in every published one)."""
    method = _get(quant, "quant_method")
    if method != "mxfp4":
        raise ValueError(
            f"gpt-oss checkpoint quantization {method!r} is not supported; supported: "
            "mxfp4 experts (as published), or none"
        )
    keys = quant.keys() if isinstance(quant, dict) else quant.to_dict().keys()
    for key in keys:
        if key not in CONFIG_KEYS:
            raise ValueError(f"quantization_config.{key} is not supported for mxfp4 checkpoints")
    for pattern in _get(quant, "modules_to_not_convert") or ():
        if fnmatch.fnmatch(EXPERTS_MODULE, pattern) or fnmatch.fnmatch(
            EXPERTS_MODULE, pattern + ".*"
        ):
            raise ValueError(
                f"quantization_config.modules_to_not_convert {pattern!r} leaves the experts "
                "unconverted, which is not supported for mxfp4 checkpoints"
            )


def _get(quant, key: str):
    return quant.get(key) if isinstance(quant, dict) else getattr(quant, key, None)


def without_quantization(hf_config):
    """A copy of the config with no quantization_config: the same model in 16 bits."""
    config = copy.deepcopy(hf_config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config
