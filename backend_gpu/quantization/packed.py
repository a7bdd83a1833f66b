"""INT4/INT8 weights as published checkpoints keep them, in one layout that every
checkpoint reader converts to and every kernel reads.

GPTQ's layout is the common ground: the integers packed along the input dimension in
32-bit words (low bits first), a scale and a zero point per group of input rows, and
GPTQ's act-order `g_idx` saying which group each input row belongs to. AWQ's and
compressed-tensors' layouts are converted into it at load, still packed, so an INT4
model keeps INT4 bytes in memory. `dequantize` is the torch reference that the CPU
forward and the GPU kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass
class PackedWeight:
    """A linear layer's weight as published INT4/INT8 checkpoints keep it, in one layout
    (GPTQ's): y = x @ W with W[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]."""

    qweight: torch.Tensor  # int32 [K * bits // 32, N]: packed along K (input), low bits first
    scales: torch.Tensor  # [G, N], float16 / bfloat16 / float32
    # uint8 [G, N], the true zero point (GPTQ v1's stored "zero - 1" already corrected;
    # symmetric: 2 ** (bits - 1) everywhere)
    zeros: torch.Tensor
    g_idx: torch.Tensor | None  # int32 [K]: group of input row k; None = k // group_size
    bits: int  # 4 or 8
    group_size: int  # K when per-channel (-1 in configs)
    in_features: int  # K
    out_features: int  # N

    def groups(self) -> torch.Tensor:
        """int64 [K]: the group of each input row, from g_idx or k // group_size."""
        if self.g_idx is not None:
            return self.g_idx.long()
        rows = torch.arange(self.in_features, device=self.qweight.device)
        return rows // self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in memory: what the memory profile counts."""
        tensors = [self.qweight, self.scales, self.zeros]
        if self.g_idx is not None:
            tensors.append(self.g_idx)
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K * bits // 32, N] from integers q [K, N] in [0, 2 ** bits): each word
    holds 32 // bits consecutive rows, the first in the lowest bits."""
    per_word = 32 // bits
    rows, cols = q.shape
    if rows % per_word:
        raise ValueError(f"{rows} rows do not fill whole 32-bit words of {bits}-bit values")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=q.device)
    words = (q.long().view(rows // per_word, per_word, cols) << shifts[None, :, None]).sum(dim=1)
    # the words are unsigned 32-bit values; int32 holds them two's complement
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R * 32 // bits, N]: the integers of `packed` [R, N], inverse of pack_rows."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] (nn.Linear's layout) in `dtype`, computed in float32."""
    q = unpack_rows(w.qweight, w.bits)
    if w.g_idx is None and w.in_features % w.group_size == 0:
        # whole groups in order: each group's scales and zeros broadcast over its rows,
        # the same values as the gather below at a fraction of the memory traffic
        grouped = q.view(-1, w.group_size, w.out_features)
        zeros, scales = w.zeros[:, None, :], w.scales[:, None, :]
        weight = ((grouped - zeros.int()).float() * scales.float()).view(q.shape)
    else:
        groups = w.groups()
        weight = (q - w.zeros[groups].int()).float() * w.scales[groups].float()
    return weight.t().to(dtype)
