"""Linear layers: packed ones whose weight holds several checkpoint tensors, so one
matmul does the work of several (q, k, v) or (gate, up); the LM head; and 8-bit
quantized versions of these and of the token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers import cpu_packed, cpu_rows
from backend_gpu.quantization import QUANTIZE_PER_CHANNEL, fp8, int8

TABLE_GROUP = 32  # values of a token-table row that share one scale


class Linear(nn.Linear):
    """nn.Linear whose float32 products of a few rows on the CPU take the form measured
    fastest on the machine (cpu_rows.py), or oneDNN's over a weight packed for it
    (cpu_packed.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:  # packed once loaded (cpu_packed.py)
            return cpu_packed.packed_linear(x, self.weight, self.bias)
        return cpu_rows.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Output rows [offset, offset + size) of the weight belong to the shard `name`."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shards.items():
            self.shard_slices[name] = slice(start, start + size)
            start += size

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        rows = self.shard_slices[shard]
        assert param.data[rows].shape == tensor.shape, (shard, tensor.shape)
        param.data[rows].copy_(tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        sizes = [s.stop - s.start for s in self.shard_slices.values()]
        return list(out.split(sizes, dim=-1))


def vocab_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight [vocab, in].T. On the CPU a few rows take the form measured
    fastest for the head's shape (cpu_rows.py); more as (weight @ x.T).T: the BLAS then
    packs the rows of x instead of the whole vocabulary-sized weight. A weight packed for
    oneDNN (cpu_packed.py) takes its linear at any count."""
    if weight.is_mkldnn:  # packed once loaded (cpu_packed.py)
        return cpu_packed.packed_linear(x, weight, None)
    if x.device.type == "cpu" and x.shape[0] > cpu_rows.MAX_ROWS:
        return torch.mm(weight, x.t()).t().contiguous()
    return cpu_rows.linear(x, weight)


def embedding(rows: int, dim: int) -> nn.Embedding:
    """A token table left uninitialized: the loader fills it. nn.Embedding's own init
    (normal_) on the meta device the loader builds on imports torch._dynamo, seconds at
    every engine start for values that are overwritten."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class LMHead(nn.Linear):
    """hidden states -> logits over the vocabulary; no bias."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vocab_matmul(x, self.weight)


class QuantizedEmbedding(nn.Module):
    """A token table (an embedding, or an LM head's weight) in INT8 with one float32
    scale per TABLE_GROUP consecutive values of a row: llama.cpp's Q8_0 layout, so a
    GGUF's Q8_0 table comes back exactly, and an outlier dimension costs precision
    only to the 31 values beside it. Rows are widened to `dtype` on lookup."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        rows, dim = weight.shape
        if dim % TABLE_GROUP:
            raise ValueError(
                f"an 8-bit token table needs a hidden size divisible by {TABLE_GROUP}, not {dim}"
            )
        self.dtype = weight.dtype
        groups = weight.detach().reshape(rows * dim // TABLE_GROUP, TABLE_GROUP)
        q, scale = int8.quantize_per_channel(groups)
        self.weight = nn.Parameter(q.view(rows, dim), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.view(rows, -1), requires_grad=False)

    def widen(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """The table's `rows` (a slice, or token ids) in `dtype`."""
        q, scale = self.weight[rows], self.weight_scale[rows]
        grouped = q.to(self.dtype).view(*scale.shape, TABLE_GROUP)
        return (grouped * scale.to(self.dtype)[..., None]).view(q.shape)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.widen(input_ids)

    def dequantize(self) -> torch.Tensor:
        return self.widen(slice(None))


# Token-table rows the CPU widens at once for the LM head: about 10 MB of float32 for a
# 640-wide table, so they are still in cache for the matmul that reads them, where the
# whole of Gemma 3's 262k-row table widened is two 670 MB temporaries per step (PERF.md).
CPU_HEAD_ROWS = 4096


class QuantizedLMHead(nn.Module):
    """The LM head over an 8-bit token table: its own, or the embedding's when tied.
    Weight-only: the table is widened in each forward, on the CPU a slab of rows at a
    time (each row's logits are the same dot products either way)."""

    def __init__(self, table: QuantizedEmbedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return vocab_matmul(x, self.table.dequantize().to(x.dtype))
        vocab = self.table.weight.shape[0]
        out = torch.empty(vocab, x.shape[0], dtype=x.dtype)  # (weight @ x.T), as vocab_matmul
        for start in range(0, vocab, CPU_HEAD_ROWS):
            rows = slice(start, start + CPU_HEAD_ROWS)
            torch.mm(self.table.widen(rows).to(x.dtype), x.t(), out=out[rows])
        return out.t().contiguous()


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is in 8 bits (FP8 E4M3 or INT8) with one float32 scale
    per output row: quantized from a loaded one (`of`), or a checkpoint's as published
    (compressed-tensors FP8 and INT8). W8A8 on FP8 GPUs (bfloat16 models), else
    weight-only: the weight is widened to the activations' dtype in each forward."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: nn.Parameter | None,
        method: str,
        dtype: torch.dtype,  # the model's
        shard_slices: dict[str, slice],
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = bias
        self.shard_slices = shard_slices
        self.w8a8 = (
            method == "fp8"
            and fp8.supports_w8a8(weight.device)
            and dtype == torch.bfloat16
            and self.in_features % 16 == 0  # _scaled_mm's shape rule
            and self.out_features % 16 == 0
        )

    @classmethod
    def of(cls, linear: nn.Linear, method: str, rows_over: ParallelGroup = SINGLE):
        """`linear` quantized by `method`. A row-parallel layer's rows are split over
        `rows_over`, whose ranks agree on the scales."""
        weight, scale = QUANTIZE_PER_CHANNEL[method](linear.weight.detach(), rows_over)
        shard_slices = getattr(linear, "shard_slices", {})
        return cls(weight, scale, linear.bias, method, linear.weight.dtype, shard_slices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w8a8:
            return fp8.w8a8_linear(x, self.weight, self.weight_scale, self.bias)
        # 8-bit values are exact in any float dtype; the row scale applies per output column
        weight, scale = self.weight, self.weight_scale
        if weight.dtype == fp8.FP8 and x.device.type == "cpu":
            # widened times a power of two, which the scale takes back: the same products
            weight, scale = fp8.widen_scaled(weight), scale * (1 / fp8.WIDEN_SCALE)
        out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
        return out if self.bias is None else out + self.bias

    split = PackedLinear.split
