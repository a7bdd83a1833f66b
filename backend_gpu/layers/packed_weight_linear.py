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
A quantized token table is such a layer too (the LM head), and PackedEmbedding looks its
rows up, dequantizing only those: from GPTQ's layout, or from the CPU kernel's where the
head runs it, so the table is held once (design.md, Quantization).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.layers.linear import PackedLinear
from backend_gpu.quantization.packed import PackedWeight, dequantize, unpack_rows

# the group sizes torch's CPU INT4 matmul takes
CPU_INT4_GROUPS = (32, 64, 128, 256)
CPU_INT4_DTYPES = (torch.bfloat16, torch.float16)
# _convert_weight_to_int4pack_for_cpu's layout, which `CpuInt4.rows` reads: blocks of 64
# output rows, [N / 64, K, 32] bytes, row j of a block in the low nibbles of column j
# (j < 32) or the high nibbles of column j - 32. Checked on each table before use.
CPU_INT4_BLOCK = 64


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
    def of(cls, w: PackedWeight, dtype: torch.dtype, table: bool = False) -> CpuInt4 | None:
        """None where the kernel cannot take `w` (or dtype), or, for a token `table`
        whose rows are also looked up, where `rows` cannot read them back."""
        k, size = w.in_features, w.group_size
        if w.bits != 4 or dtype not in CPU_INT4_DTYPES or w.qweight.device.type != "cpu":
            return None
        if size not in CPU_INT4_GROUPS or k % size or w.out_features % 16:
            return None  # (the kernel's layout takes outputs in sixteens)
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
        cpu = cls(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().contiguous(), 2),
            torch.stack([scales, zeros], dim=-1).to(dtype).contiguous(),
            size,
            perm,
        )
        if table and not cpu._reads_back(q):
            return None
        return cpu

    def _reads_back(self, q: torch.Tensor) -> bool:
        """Whether `rows` finds the integers q [K, N] in the kernel's layout: the layout
        is torch's, not a documented one, so a table is checked on a sample of rows
        (every row of the first block, and rows spread over the rest)."""
        k, n = q.shape
        if n % CPU_INT4_BLOCK:
            return False
        sample = torch.cat([torch.arange(CPU_INT4_BLOCK), torch.linspace(0, n - 1, 257).long()])
        return torch.equal(self._integers(sample, k), q.t()[sample].to(torch.uint8))

    def _integers(self, ids: torch.Tensor, k: int) -> torch.Tensor:
        """uint8 [len(ids), K]: the 4-bit values of output rows `ids`, columns sorted."""
        half = CPU_INT4_BLOCK // 2
        j = ids % CPU_INT4_BLOCK
        # two index tensors around a slice: the indexed dimension comes first, [B, K]
        words = self.weight.view(-1, k, half)[ids // CPU_INT4_BLOCK, :, j % half]
        shifts = (j >= half).to(torch.uint8)[:, None] * 4
        return (words >> shifts) & 15

    def rows(self, ids: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
        """[len(ids), K] in `dtype`: output rows `ids` dequantized, in x's column order."""
        groups = torch.arange(k, device=ids.device) // self.group_size
        # the rows' columns first: [G, B, 2], then each input's group, [K, B, 2]
        scales_and_zeros = self.scales_and_zeros[:, ids][groups].float()
        scales, zeros = scales_and_zeros.unbind(dim=-1)
        sorted_rows = (self._integers(ids, k).float() - 8) * scales.t() + zeros.t()
        if self.perm is None:
            return sorted_rows.to(dtype)
        rows = torch.empty_like(sorted_rows)
        rows[:, self.perm] = sorted_rows
        return rows.to(dtype)

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
        table: bool = False,  # a token table, its rows also looked up (PackedEmbedding)
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dtype = dtype
        self.bias = bias
        self.shard_slices = shard_slices
        cpu = CpuInt4.of(weight, dtype, table)
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

    def _cpu(self) -> CpuInt4:
        return CpuInt4(self.weight_int4, self.scales_and_zeros, self.group_size, self.perm)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), in_features] in the model's dtype: output rows `ids` of the
        weight, dequantized, where the layer is a token table (one row per token)."""
        if self.cpu_int4:
            return self._cpu().rows(ids, self.in_features, self.dtype)
        w = self.packed
        part = dataclasses.replace(
            w,
            qweight=w.qweight[:, ids],
            scales=w.scales[:, ids],
            zeros=w.zeros[:, ids],
            out_features=len(ids),
        )
        return dequantize(part, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.cpu_int4:
            out = self._cpu().matmul(x2)
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


class PackedEmbedding(nn.Module):
    """A token table kept packed: a lookup dequantizes only the rows it reads from
    `table`, a PackedWeightLinear [vocab, hidden] that is also the LM head when the
    embeddings are tied, so the model holds the table's bytes once."""

    def __init__(self, table: PackedWeightLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(input_ids.reshape(-1))
        return rows.view(*input_ids.shape, self.table.in_features)
