"""The LoRA delta of one projection for a whole step: y += scale * (x @ A^T) @ B^T, each
token under its own sequence's adapter slot (or none). The one place that picks the
path: on CUDA the Triton kernels (layers/triton_lora.py: one launch per op whatever the
mix of adapters, and no host sync, so decodes stay in CUDA graphs); elsewhere torch:
the step's tokens gathered by adapter, then one batched matmul pair over all the
adapters present where their groups are about the same size (decodes: on a CPU a
matmul per adapter costs more in calls than in arithmetic), else one matmul pair per
adapter; never one per token.
Both round as PEFT's lora_B(lora_A(x)) * scaling does: the shrink in x's dtype, its
result rounded to B's dtype, then scaled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# a step's tokens of one adapter slot: a slice when they are one run, else their indices
Rows = slice | torch.Tensor


@dataclass
class StepSlots:
    """Which adapter slot each token of the step runs under."""

    kernels: bool  # CUDA: the Triton path reads `idx` and `groups` on the device
    idx: torch.Tensor  # [capacity] int32, -1: no adapter; a persistent buffer (graphs)
    host_groups: list[tuple[int, Rows]] = field(default_factory=list)  # the torch path's
    batched: Batched | None = None  # the torch path's groups padded to one shape
    groups: object = None  # the kernels' AdapterGroups of this forward (kernels only)


@dataclass
class Batched:
    """The torch path's groups as one batch over the slot range [first, first + count):
    each slot's rows padded to M (a slot of the range with no rows: all padding), so the
    stacks' slots are a view, not a gather (a copy of every B, as large as the reads)."""

    first: int
    count: int
    index: torch.Tensor  # [count, M] rows of the step; padding repeats row 0
    rows: torch.Tensor  # the real rows, in the order of index's real entries
    real: torch.Tensor | None  # [count * M] which entries of index are real; None: all
    slot_list: list[int]

    @classmethod
    def of(cls, groups: list[tuple[int, Rows]]) -> Batched | None:
        """None where one group, or padding would more than double the work."""
        if len(groups) < 2:
            return None
        by_slot = {
            slot: list(range(r.start, r.stop)) if isinstance(r, slice) else r.tolist()
            for slot, r in groups
        }
        first, last = min(by_slot), max(by_slot)
        lists = [by_slot.get(slot, []) for slot in range(first, last + 1)]
        width = max(map(len, lists))
        real_rows = [r for rows in lists for r in rows]
        if width * len(lists) > 2 * len(real_rows):
            return None
        index = torch.tensor([rows + [0] * (width - len(rows)) for rows in lists])
        real = torch.tensor([[i < len(rows) for i in range(width)] for rows in lists]).flatten()
        return cls(
            first,
            len(lists),
            index,
            torch.tensor(real_rows),
            None if bool(real.all()) else real,
            list(by_slot),
        )


def group_rows(seq_slots: list[int], num_new: list[int]) -> list[tuple[int, Rows]]:
    """(slot, rows) per adapter slot present, from each sequence's slot and token count."""
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for slot, n in zip(seq_slots, num_new, strict=True):
        if slot >= 0:
            runs.setdefault(slot, []).append((start, start + n))
        start += n
    groups: list[tuple[int, Rows]] = []
    for slot, spans in runs.items():
        if len(spans) == 1 or all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)):
            groups.append((slot, slice(spans[0][0], spans[-1][1])))
        else:
            groups.append((slot, torch.cat([torch.arange(a, b) for a, b in spans])))
    return groups


def regroup(step: StepSlots, num_tokens: int, num_slots: int) -> None:
    """At the start of a forward (inside a CUDA graph's capture too): the kernels' grouping
    of the step's tokens, made once and shared by every projection."""
    if step.kernels:
        from backend_gpu.layers.triton_lora import group_by_adapter

        step.groups = group_by_adapter(step.idx[:num_tokens], num_slots)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    step: StepSlots,
    host: SlotsOnHost,
) -> None:
    """y [T, N] (a column range of the projection's output) += the delta of x [T, K]
    under stacks a [S, R, K] and b [S, N, R], scale [S] float32."""
    if step.kernels:
        from backend_gpu.layers.triton_lora import lora_expand, lora_shrink

        idx = step.idx[: x.shape[0]]
        t = lora_shrink(x, a, idx, step.groups)
        lora_expand(y, t, b, idx, scale, step.groups)
        return
    if step.batched is not None:
        _add_batched(y, x, a, b, scale, step.batched, host)
        return
    for slot, rows in step.host_groups:
        rank = host.ranks[slot]
        if rank == 0:  # this adapter leaves this projection alone
            continue
        t = x[rows] @ a[slot, :rank].T
        delta = (t.to(b.dtype) @ b[slot, :, :rank].T) * host.scales[slot]
        if isinstance(rows, slice):
            y[rows] += delta.to(y.dtype)
        else:
            y.index_add_(0, rows, delta.to(y.dtype))


def _add_batched(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    batched: Batched,
    host: SlotsOnHost,
) -> None:
    """The torch path's delta for all groups at once: one bmm pair at the largest rank
    present (a smaller rank's padding is zeros)."""
    rank = max(host.ranks[slot] for slot in batched.slot_list)
    if rank == 0:
        return
    slots = slice(batched.first, batched.first + batched.count)
    t = torch.bmm(x[batched.index], a[slots, :rank].transpose(1, 2))
    delta = torch.bmm(t.to(b.dtype), b[slots, :, :rank].transpose(1, 2))
    delta = (delta * scale[slots].view(-1, 1, 1)).flatten(0, 1)
    if batched.real is not None:
        delta = delta[batched.real]
    y.index_add_(0, batched.rows, delta.to(y.dtype))


def add_lora_packed(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    parts: list[tuple[torch.Tensor, slice]],
    scale: torch.Tensor,
    batched: Batched,
    rank: int,
) -> None:
    """The torch path's deltas of a packed projection's sub-projections (q/k/v, gate/up),
    which share their input: one gather of x and one shrink for all of them over a [S, R,
    n, K] (the subs' A interleaved by rank, so the first `rank` rows of every sub are one
    view), then an expand per sub into its columns and one add. y [T, N] is the whole
    packed output; parts are (B [S, N_i, R], columns) in column order, covering y."""
    slots = slice(batched.first, batched.first + batched.count)
    shrink = a[slots, :rank].flatten(1, 2)  # [count, rank * n, K]
    t = torch.bmm(x[batched.index], shrink.transpose(1, 2)).unflatten(2, (rank, len(parts)))
    t = t.permute(3, 0, 1, 2).contiguous()  # [n, count, M, rank]: each sub's rows dense
    deltas = [
        torch.bmm(t[i].to(b.dtype), b[slots, :, :rank].transpose(1, 2))
        for i, (b, _) in enumerate(parts)
    ]
    delta = (torch.cat(deltas, dim=2) * scale[slots].view(-1, 1, 1)).flatten(0, 1)
    if batched.real is not None:
        delta = delta[batched.real]
    y.index_add_(0, batched.rows, delta.to(y.dtype))


@dataclass
class SlotsOnHost:
    """One projection's per-slot rank (0: not adapted) and scale, read by the torch path
    without a device sync."""

    ranks: list[int]
    scales: list[float]
