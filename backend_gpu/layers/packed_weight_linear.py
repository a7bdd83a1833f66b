"""A linear layer whose weight stays INT4/INT8 as a published checkpoint holds it (a
PackedWeight: GPTQ, AWQ, compressed-tensors pack-quantized): the model is never
widened to 16 or 32 bits at load, so an INT4 model holds a quarter of the bytes.

On CUDA, the Triton kernel of triton_int4.py (`int4_matmul`), which dequantizes in
registers. On the CPU, two paths, chosen once per layer by the model's dtype (design.md,
Quantization, has the measurement):
- bfloat16/float16 activations: torch's packed INT4 CPU matmul
  (aten._weight_int4pack_mm_for_cpu), the weight repacked at load into its layout, a
  zero point per group as its float `zero` ((2^(b-1) - zero) * scale), act-order's rows
  sorted by group with x's columns permuted to match;
- float32 activations (where that kernel is slowest), 8-bit weights, and groups it
  cannot take: the layer's weight dequantized in each forward, then one matmul. Only
  this layer's weight is ever widened, and only for the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.layers.linear import PackedLinear
from backend_gpu.quantization.packed import PackedWeight, dequantize, unpack_rows

# the group sizes torch's CPU INT4 matmul takes
CPU_INT4_GROUPS = (32, 64, 128, 256)
CPU_INT4_DTYPES = (torch.bfloat16, torch.float16)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


@dataclass
class CpuInt4:
    """A PackedWeight in the layout of torch's CPU INT4 matmul."""

    weight: torch.Tensor  # uint8, _convert_weight_to_int4pack_for_cpu's
    scales_and_zeros: torch.Tensor  # [G, N, 2]: w = (q - 8) * scale + zero
    group_size: int
    perm: torch.Tensor | None  # act-order: x's columns in the sorted rows' order

    @classmethod
    def of(cls, w: PackedWeight, dtype: torch.dtype) -> CpuInt4 | None:
        """None where the kernel cannot take `w` (or dtype)."""
        k, size = w.in_features, w.group_size
        if w.bits != 4 or dtype not in CPU_INT4_DTYPES or w.qweight.device.type != "cpu":
            return None
        if size not in CPU_INT4_GROUPS or k % size:
            return None
        q = unpack_rows(w.qweight, 4)
        perm = None
        if w.g_idx is not None:
            # sorted by group, rows must fall into whole groups of `size` in order
            perm = torch.argsort(w.g_idx, stable=True)
            in_order = torch.arange(k, device=perm.device) // size
            if not torch.equal(w.g_idx[perm].long(), in_order):
                return None
            q = q[perm]
        scales = w.scales.float()
        zeros = (8 - w.zeros.float()) * scales
        return cls(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().contiguous(), 2),
            torch.stack([scales, zeros], dim=-1).to(dtype).contiguous(),
            size,
            perm,
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x[:, self.perm]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.weight, self.group_size, self.scales_and_zeros
        )


class PackedWeightLinear(nn.Module):
    """y = x @ W.T + bias over a PackedWeight; `shard_slices` as PackedLinear's when the
    layer is fused (q/k/v, gate/up)."""

    def __init__(
        self,
        weight: PackedWeight,
        bias: nn.Parameter | None,
        dtype: torch.dtype,  # the model's, which the CPU path's scales take
        shard_slices: dict[str, slice],
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        self.bias = bias
        self.shard_slices = shard_slices
        cpu = CpuInt4.of(weight, dtype)
        self.cpu_int4 = cpu is not None
        if cpu is not None:  # the kernel's layout instead of GPTQ's, not beside it
            self.weight_int4 = _frozen(cpu.weight)
            self.scales_and_zeros = _frozen(cpu.scales_and_zeros)
            self.perm = None if cpu.perm is None else _frozen(cpu.perm)
            return
        # contiguous, as the kernels read them (a tensor-parallel cut of columns is not)
        self.qweight = _frozen(weight.qweight.contiguous())
        self.scales = _frozen(weight.scales.contiguous())
        self.zeros = _frozen(weight.zeros.contiguous())
        self.g_idx = None if weight.g_idx is None else _frozen(weight.g_idx.contiguous())

    @property
    def packed(self) -> PackedWeight:
        """The weight in GPTQ's layout (not on the CPU INT4 path, which holds its own)."""
        return PackedWeight(
            self.qweight,
            self.scales,
            self.zeros,
            self.g_idx,
            self.bits,
            self.group_size,
            self.in_features,
            self.out_features,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.cpu_int4:
            cpu = CpuInt4(self.weight_int4, self.scales_and_zeros, self.group_size, self.perm)
            out = cpu.matmul(x2)
        elif x.is_cuda:
            # here, not at the top: Triton is only there where CUDA is
            from backend_gpu.layers.triton_int4 import int4_matmul

            out = int4_matmul(x2, self.packed)
        else:
            out = F.linear(x2, dequantize(self.packed, x.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    split = PackedLinear.split
