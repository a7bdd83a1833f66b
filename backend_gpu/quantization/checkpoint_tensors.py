"""One quantized layer's checkpoint tensors, converted to what the engine holds: a
PackedWeight (GPTQ, AWQ, compressed-tensors pack-quantized) or an 8-bit weight with a
float32 scale per output channel (compressed-tensors FP8 and INT8).

Every tensor's dtype and shape is checked against the layer's (out, in) before it is
used, and a disagreement names the tensor: a checkpoint whose config and tensors
disagree fails at start, not as garbage at the first step. The layouts, from their
writers' definitions:
- GPTQ (AutoGPTQ, GPTQModel): qweight int32 [K*b/32, N] packed along K, low bits first;
  qzeros int32 [G, N*b/32] packed along N the same way, each zero less one in v1;
  scales [G, N]; g_idx int32 [K].
- AWQ GEMM (AutoAWQ): qweight int32 [K, N/8] and qzeros int32 [G, N/8], packed along N
  with nibble i holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales [G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, K*b/32], consecutive
  columns low bits first, values offset by 2^(b-1) (GPTQ's qweight transposed);
  weight_scale [N, G]; weight_zero_point int32 [N*b/32, G] packed along N, offset the
  same way; weight_shape [2].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_gpu.quantization.checkpoint_config import WeightScheme
from backend_gpu.quantization.packed import PackedWeight, pack_rows, unpack_rows

# any of these in a module's tensors: the module is quantized in the checkpoint
MARKERS = ("qweight", "weight_packed", "weight_scale")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]


@dataclass
class EightBitWeight:
    """An FP8 or INT8 weight [N, K] with a float32 scale per output channel [N]."""

    weight: torch.Tensor
    scale: torch.Tensor
    method: str  # "fp8" | "int8": QuantizedLinear's


def expected_tensors(scheme: WeightScheme) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names, after the module's dotted name."""
    if scheme.layout == "gptq":
        g_idx = {"g_idx"}
        return {"qweight", "qzeros", "scales"} | (g_idx if scheme.act_order else set()), g_idx
    if scheme.layout == "awq":
        return {"qweight", "qzeros", "scales"}, set()
    if scheme.layout == "pack-quantized":
        required = {"weight_packed", "weight_scale", "weight_shape"}
        if not scheme.symmetric:
            required.add("weight_zero_point")
        return required, set()
    optional = {"weight_zero_point", "input_zero_point"}
    return {"weight", "weight_scale"} | ({"input_scale"} if scheme.static_inputs else set()), (
        optional | {"input_scale"}
    )


class TensorCheck:
    """Shape and dtype checks on one module's tensors, naming the tensor."""

    def __init__(self, module: str, tensors: dict[str, torch.Tensor]) -> None:
        self.module = module
        self.tensors = tensors

    def __call__(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]):
        t = self.tensors[name]
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(
                f"{self.module}.{name}: {t.dtype} {tuple(t.shape)} in the checkpoint, "
                f"expected {'/'.join(str(d) for d in dtypes)} {shape} for this layer's "
                "shape and the quantization_config"
            )
        return t


def convert_module(
    module: str,
    scheme: WeightScheme,
    tensors: dict[str, torch.Tensor],
    out_features: int,
    in_features: int,
) -> PackedWeight | EightBitWeight:
    """The engine's form of checkpoint module `module` (out_features x in_features)."""
    check = TensorCheck(module, tensors)
    if scheme.layout in ("float-quantized", "int-quantized"):
        return _eight_bit(check, scheme, out_features, in_features)
    bits = scheme.bits
    per_word = 32 // bits
    if in_features % per_word or out_features % per_word:
        raise ValueError(
            f"{module}: {out_features} x {in_features} does not pack into whole "
            f"32-bit words of {bits}-bit values"
        )
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    groups = -(-in_features // group_size)
    if scheme.layout == "gptq":
        qweight, scales, zeros, g_idx = _gptq(check, scheme, out_features, in_features, groups)
    elif scheme.layout == "awq":
        qweight, scales, zeros, g_idx = _awq(check, out_features, in_features, groups)
    else:
        qweight, scales, zeros, g_idx = _pack_quantized(
            check, scheme, out_features, in_features, groups
        )
    if g_idx is not None:
        g_idx = _check_g_idx(module, g_idx, groups, group_size)
    return PackedWeight(qweight, scales, zeros, g_idx, bits, group_size, in_features, out_features)


def _zeros(module: str, name: str, values: torch.Tensor) -> torch.Tensor:
    if int(values.max()) > 255 or int(values.min()) < 0:
        raise ValueError(f"{module}.{name}: a zero point outside 0..255")
    return values.to(torch.uint8)


def _gptq(check: TensorCheck, scheme: WeightScheme, n: int, k: int, groups: int):
    bits = scheme.bits
    qweight = check("qweight", (k * bits // 32, n), (torch.int32,))
    scales = check("scales", (groups, n), FLOAT_DTYPES)
    qzeros = check("qzeros", (groups, n * bits // 32), (torch.int32,))
    zeros = unpack_rows(qzeros.t(), bits).t()
    if scheme.gptq_v1_zeros:  # AutoGPTQ's dequantization adds the one back
        zeros = zeros + 1
    g_idx = None
    if "g_idx" in check.tensors:
        g_idx = check("g_idx", (k,), (torch.int32, torch.int64))
    return qweight, scales, _zeros(check.module, "qzeros", zeros), g_idx


def _awq(check: TensorCheck, n: int, k: int, groups: int):
    qweight = check("qweight", (k, n // 8), (torch.int32,))
    scales = check("scales", (groups, n), FLOAT_DTYPES)
    qzeros = check("qzeros", (groups, n // 8), (torch.int32,))
    q = _awq_unpack(qweight)
    zeros = _awq_unpack(qzeros)
    return pack_rows(q, 4), scales, _zeros(check.module, "qzeros", zeros), None


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C*8] from AWQ's [R, C] words packed along columns in its order."""
    nibbles = unpack_rows(words.reshape(1, -1), 4).t().reshape(*words.shape, 8)
    return nibbles[..., AWQ_REVERSE_ORDER].reshape(words.shape[0], -1)


def _pack_quantized(check: TensorCheck, scheme: WeightScheme, n: int, k: int, groups: int):
    bits = scheme.bits
    shape = check("weight_shape", (2,), (torch.int32, torch.int64))
    if shape.tolist() != [n, k]:
        raise ValueError(f"{check.module}.weight_shape: {shape.tolist()}, expected {[n, k]}")
    packed = check("weight_packed", (n, k * bits // 32), (torch.int32,))
    scales = check("weight_scale", (n, groups), FLOAT_DTYPES).t().contiguous()
    offset = 1 << (bits - 1)  # values and zero points are stored offset to unsigned
    if scheme.symmetric:
        zeros = torch.full((groups, n), offset, dtype=torch.uint8)
    else:
        rows = -(-n // (32 // bits))
        zp = check("weight_zero_point", (rows, groups), (torch.int32,))
        zeros = _zeros(check.module, "weight_zero_point", unpack_rows(zp, bits)[:n].t())
    return packed.t().contiguous(), scales, zeros, None


def _check_g_idx(
    module: str, g_idx: torch.Tensor, groups: int, group_size: int
) -> torch.Tensor | None:
    """g_idx as int32, or None where it says only k // group_size (GPTQ writes one for
    every layer); every group must hold group_size rows, as act-order makes them."""
    g_idx = g_idx.to(torch.int32)
    in_order = torch.arange(g_idx.numel(), dtype=torch.int32) // group_size
    if torch.equal(g_idx, in_order):
        return None
    counts = torch.bincount(g_idx.long().clamp(0, groups), minlength=groups + 1)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups or counts[:groups].max() > group_size:
        raise ValueError(
            f"{module}: g_idx is not an act-order grouping into {groups} groups of {group_size}"
        )
    return g_idx


def _eight_bit(check: TensorCheck, scheme: WeightScheme, n: int, k: int) -> EightBitWeight:
    fp8 = scheme.layout == "float-quantized"
    dtype = torch.float8_e4m3fn if fp8 else torch.int8
    weight = check("weight", (n, k), (dtype,))
    scale = check.tensors["weight_scale"]
    if scale.numel() not in (1, n) or scale.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{check.module}.weight_scale: {scale.dtype} {tuple(scale.shape)}, expected a "
            f"float scale per output channel ({n}, 1) or one for the tensor"
        )
    zero = check.tensors.get("weight_zero_point")
    if zero is not None and bool(zero.any()):
        raise ValueError(f"{check.module}.weight_zero_point: symmetric weights need zeros")
    scale = scale.float().reshape(-1).expand(n).contiguous()
    return EightBitWeight(weight, scale, "fp8" if fp8 else "int8")
