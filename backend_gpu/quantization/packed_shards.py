"""Cutting quantized weights for tensor parallelism and joining the parts of a fused
layer (q/k/v, gate/up), without unpacking them.

A column-parallel rank keeps output columns [start, stop): every tensor is cut along N
and g_idx is kept whole. A row-parallel rank keeps input rows [start, stop): whole
32-bit words of qweight, and the groups its rows fall in. With act-order (g_idx) a
rank's rows fall in any of the groups, so it keeps every group's scales and zeros (at
group 128 they add 5% to the INT4 bytes) and its rows of g_idx: the single-device
weight, exactly, with nothing permuted across ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from backend_gpu.quantization.checkpoint_tensors import EightBitWeight
from backend_gpu.quantization.packed import PackedWeight


def cut_columns(w: PackedWeight | EightBitWeight, start: int, stop: int):
    """Output features [start, stop) of `w`."""
    if isinstance(w, EightBitWeight):
        return EightBitWeight(w.weight[start:stop], w.scale[start:stop], w.method)
    return dataclasses.replace(
        w,
        qweight=w.qweight[:, start:stop],
        scales=w.scales[:, start:stop],
        zeros=w.zeros[:, start:stop],
        out_features=stop - start,
    )


def pad_columns(w: PackedWeight, columns: int) -> PackedWeight:
    """`w` with zero output features appended up to `columns`: a vocabulary-parallel
    table's last rank, whose rows run past the vocabulary (tp_shards.VocabShard)."""
    if w.out_features >= columns:
        return w
    extra = columns - w.out_features

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1)

    return dataclasses.replace(
        w,
        qweight=pad(w.qweight),
        scales=pad(w.scales),  # zero scales: the padding rows dequantize to zero
        zeros=pad(w.zeros),
        out_features=columns,
    )


def cut_rows(w: PackedWeight | EightBitWeight, start: int, stop: int, module: str):
    """Input features [start, stop) of `w`, a layer of checkpoint module `module`."""
    if isinstance(w, EightBitWeight):
        return EightBitWeight(w.weight[:, start:stop], w.scale, w.method)
    per_word = 32 // w.bits
    if start % per_word or stop % per_word:
        raise ValueError(
            f"{module}: tensor parallelism cuts its inputs at {start}..{stop}, not at "
            f"whole 32-bit words of {w.bits}-bit values"
        )
    part = dataclasses.replace(
        w, qweight=w.qweight[start // per_word : stop // per_word], in_features=stop - start
    )
    if w.g_idx is not None:  # act-order: every group's scales and zeros, this rank's rows
        return dataclasses.replace(part, g_idx=w.g_idx[start:stop])
    size = w.group_size
    if size >= w.in_features:  # one group per output channel: the rank's rows are one
        return dataclasses.replace(part, group_size=stop - start)
    first, last = start // size, -(-stop // size)
    part = dataclasses.replace(part, scales=w.scales[first:last], zeros=w.zeros[first:last])
    if start % size:  # a group cut at the rank's first row: its rows' groups, explicitly
        rows = torch.arange(start, stop, dtype=torch.int32, device=w.qweight.device)
        return dataclasses.replace(part, g_idx=rows // size - first)
    return part


def join_columns(parts: list[PackedWeight | EightBitWeight], names: list[str]):
    """One weight whose output features are `parts`' in order (a fused layer's), from
    checkpoint modules `names`: they must share their input's quantization."""
    first = parts[0]
    if isinstance(first, EightBitWeight):
        if any(not isinstance(p, EightBitWeight) or p.method != first.method for p in parts):
            raise ValueError(f"{', '.join(names)}: one fused layer, quantized differently")
        weight = torch.cat([p.weight for p in parts])
        return EightBitWeight(weight, torch.cat([p.scale for p in parts]), first.method)
    for part, name in zip(parts, names, strict=True):
        same = (
            isinstance(part, PackedWeight)
            and (part.bits, part.group_size, part.in_features)
            == (first.bits, first.group_size, first.in_features)
            and (part.g_idx is None) == (first.g_idx is None)
            and (part.g_idx is None or torch.equal(part.g_idx, first.g_idx))
        )
        if not same:
            raise ValueError(
                f"{name} and {names[0]} are one fused layer in the engine, so they need the "
                "same bits, group size and g_idx"
            )
    return dataclasses.replace(
        first,
        qweight=torch.cat([p.qweight for p in parts], dim=1),
        scales=torch.cat([p.scales for p in parts], dim=1),
        zeros=torch.cat([p.zeros for p in parts], dim=1),
        out_features=sum(p.out_features for p in parts),
    )


def cut_parts(w: PackedWeight | EightBitWeight, ranges: list[tuple[int, int]], names: list[str]):
    """Output features [lo, hi) of each of `ranges` of `w`, joined in order: a fused
    checkpoint module's parts (Phi-3's q, k and v) each cut to a rank's rows."""
    return join_columns([cut_columns(w, lo, hi) for lo, hi in ranges], names)
