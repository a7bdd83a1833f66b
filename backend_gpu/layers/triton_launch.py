"""What the Triton kernels' wrappers (attention, LoRA, packed INT4/INT8 matmul) decide
alike when they launch: the precision of a float32 tl.dot, and how many shares of its
work a program's job is split into so a small batch still fills the GPU."""

from __future__ import annotations

import functools

import torch
import triton


def dot_precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input_precision for operands of `dtype`: float32 stays float32 (TF32
    would cost ~1e-3), as torch's matmuls on CUDA by default."""
    return "ieee" if dtype == torch.float32 else None


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_to_fill(device: torch.device, programs: int, most: int) -> int:
    """Shares to split each of `programs` programs' work into so every SM gets two
    programs: a power of two, at least 1 and at most `most`; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms(device), programs))
    return max(1, min(wanted, most))
