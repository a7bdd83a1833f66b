"""The resident adapters on the device: per layer and per projection, a stack of
`max_loras` slots of A [R, in] and B [out, R] (R = max_lora_rank, a smaller rank padded
with zeros), allocated once at start so their addresses never move (CUDA graphs read
them where they were captured); and the model's projections wrapped to add each token's
slot's delta to the base output.

The engine fuses q/k/v and gate/up into one matmul each (layers/linear.py): an adapter's
q, k and v go to their own column ranges of that output, each a shrink and expand of
its own. Writing a slot copies one adapter from host memory; clearing it zeroes it.

Under tensor parallelism (tp_shards.py) a rank holds its share of each adapter as it
holds its share of the layer: a column-parallel projection's B by output rows (A whole),
a row-parallel one's A by input columns (B whole): each rank's delta is then a partial
sum like its base output's, and the layer's one all-reduce adds both.
"""

from __future__ import annotations

import torch
from torch import nn

from backend_gpu.lora.ops import (
    Batched,
    SlotsOnHost,
    StepSlots,
    add_lora,
    add_lora_packed,
    group_rows,
    regroup,
)
from backend_gpu.lora.peft_files import PROJECTIONS, AdapterWeights, BaseShapes
from backend_gpu.tp_shards import CheckpointShards, ShardRead


def _shard_of(shards: CheckpointShards | None, proj: str) -> ShardRead | None:
    """What this rank holds of projection `proj` (None: all of it)."""
    return None if shards is None else shards(f"model.layers.0.{proj}.weight")


class ProjectionStack:
    """One projection's slots in one layer."""

    def __init__(
        self,
        fan_in: int,
        fan_out: int,
        slots: int,
        rank: int,
        dtype,
        device: torch.device,
        a: torch.Tensor | None = None,
    ) -> None:
        # `a`: this projection's view of a packed module's shared A (PackedA)
        self.a = torch.zeros(slots, rank, fan_in, dtype=dtype, device=device) if a is None else a
        self.b = torch.zeros(slots, fan_out, rank, dtype=dtype, device=device)
        self.scale = torch.zeros(slots, dtype=torch.float32, device=device)
        self.host = SlotsOnHost([0] * slots, [0.0] * slots)

    def write(
        self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float
    ) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        # the adapter's scale even where it leaves this projection alone (zero A and B add
        # nothing): a packed module's subs then share one scale per slot (PackedA)
        self.scale[slot] = scale
        if a is None or b is None:
            self.host.ranks[slot], self.host.scales[slot] = 0, 0.0
            return
        rank = a.shape[0]
        self.a[slot, :rank].copy_(a)
        self.b[slot, :, :rank].copy_(b)
        self.host.ranks[slot], self.host.scales[slot] = rank, scale


class PackedA:
    """The torch path's A of a packed module's subs in one tensor [S, R, n, K]: sub i's
    stack is the view [:, :, i], so the subs, which share their input, shrink in one
    gather and one matmul (add_lora_packed) where they would take n of each."""

    def __init__(self, fan_in: int, subs: int, slots: int, rank: int, dtype, device) -> None:
        self.a = torch.zeros(slots, rank, subs, fan_in, dtype=dtype, device=device)

    def view(self, i: int) -> torch.Tensor:
        return self.a[:, :, i]


class LoRALinear(nn.Module):
    """A projection (plain, packed or 8-bit) plus the step's adapters' deltas over its
    column ranges: `subs` holds (stack, columns) per adapted sub-projection, in column
    order; `packed`, where given, their shared A (torch path only)."""

    def __init__(
        self,
        base: nn.Module,
        subs: list[tuple[ProjectionStack, slice]],
        step: StepSlots,
        packed: PackedA | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.subs = subs
        self.step = step
        self.packed = packed
        if hasattr(base, "split"):  # a packed projection's callers split its output
            self.split = base.split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if self.packed is not None and step.batched is not None:
            slots = step.batched.slot_list
            rank = max(stack.host.ranks[s] for stack, _ in self.subs for s in slots)
            if rank:
                parts = [(stack.b, cols) for stack, cols in self.subs]
                scale = self.subs[0][0].scale
                add_lora_packed(out, x, self.packed.a, parts, scale, step.batched, rank)
        elif step.kernels or step.host_groups:
            for stack, cols in self.subs:
                add_lora(out[:, cols], x, stack.a, stack.b, stack.scale, step, stack.host)
        return out


class LoRAStacks:
    """Every adapted projection's slots in a model, and the step's per-token slots."""

    def __init__(
        self,
        model: nn.Module,
        shapes: BaseShapes,
        slots: int,
        rank: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        shards: CheckpointShards | None = None,
    ) -> None:
        self.num_slots = slots
        self.shards = shards
        self.step = StepSlots(
            kernels=device.type == "cuda",
            idx=torch.full((max_tokens,), -1, dtype=torch.int32, device=device),
        )
        self.stacks: dict[tuple[int, str], ProjectionStack] = {}
        self.shapes, self.rank, self.dtype, self.device = shapes, rank, dtype, device
        for i, layer in enumerate(model.model.layers):
            for owner in (layer.self_attn, layer.mlp):
                self._wrap(owner, i)
        # the kernels group the step's tokens once per forward, inside a graph's capture too
        model.model.register_forward_pre_hook(
            lambda _module, args: regroup(self.step, args[0].shape[0], slots)
        )

    def _features(self, proj: str) -> tuple[int, int]:
        """(fan_in, fan_out) of what this rank holds of `proj`."""
        fan_in, fan_out = self.shapes.features[proj]
        read = _shard_of(self.shards, proj)
        if read is not None and read.dim == 0:  # column-parallel: output rows
            fan_out = read.stop - read.start
        elif read is not None:  # row-parallel: input columns
            fan_in = read.stop - read.start
        return fan_in, fan_out

    def _wrap(self, owner: nn.Module, layer: int) -> None:
        """Each of `owner`'s projections wrapped over its subs' stacks (made here)."""
        slots, rank, dtype, device = self.num_slots, self.rank, self.dtype, self.device
        for module_name in dict.fromkeys(m for m, _ in PROJECTIONS.values()):
            base = getattr(owner, module_name, None)
            if base is None:
                continue
            projs = [(p, shard) for p, (name, shard) in PROJECTIONS.items() if name == module_name]
            # the torch path shrinks a packed module's subs at once (their input is one)
            packed = None
            if len(projs) > 1 and not self.step.kernels:
                fan_in = self._features(projs[0][0])[0]
                packed = PackedA(fan_in, len(projs), slots, rank, dtype, device)
            subs = []
            for i, (proj, shard) in enumerate(projs):
                fan_in, fan_out = self._features(proj)
                a = None if packed is None else packed.view(i)
                stack = ProjectionStack(fan_in, fan_out, slots, rank, dtype, device, a)
                self.stacks[layer, proj] = stack
                subs.append((stack, base.shard_slices[shard] if shard else slice(None)))
            setattr(owner, module_name, LoRALinear(base, subs, self.step, packed))

    def write(self, slot: int, weights: AdapterWeights | None) -> None:
        """Put `weights` in `slot` (None: clear it)."""
        scale = 0.0 if weights is None else weights.info.scale
        for key, stack in self.stacks.items():
            pair = None if weights is None else weights.tensors.get(key)
            a, b = pair or (None, None)
            read = _shard_of(self.shards, key[1])
            if a is not None and b is not None and read is not None:
                if read.dim == 0:
                    b = b[read.start : read.stop]
                else:
                    a = a[:, read.start : read.stop]
            stack.write(slot, a, b, scale)

    def set_step(self, seq_slots: list[int], num_new: list[int]) -> None:
        """The step's sequences' slots (-1: none) and their token counts; the tokens past
        them (a graph's padding) run under none."""
        num_tokens = sum(num_new)
        if self.step.kernels:
            per_token = [s for s, n in zip(seq_slots, num_new, strict=True) for _ in range(n)]
            self.step.idx.fill_(-1)
            self.step.idx[:num_tokens].copy_(torch.tensor(per_token, dtype=torch.int32))
        else:
            self.step.host_groups = group_rows(seq_slots, num_new)
            self.step.batched = Batched.of(self.step.host_groups)
