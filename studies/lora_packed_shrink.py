"""The CPU path's LoRA delta of a packed projection (q/k/v, gate/up), its subs one at a
time (add_lora per sub: a gather, a shrink, an expand and an add each) against all at
once (add_lora_packed: one gather and one shrink for all, an expand each, one add).

    python -m studies.lora_packed_shrink [--out OUTDIR]

One decode step's shapes: 16 sequences over 8 adapter slots of rank 16, hidden 512 (the
LoRA study's model), q/k/v 512/256/256 wide, gate/up 1376 each. One torch thread; each
figure is the best of --repeat rounds of --number calls, so a loaded machine slows it
less than it would a mean. OUTDIR/lora_packed_shrink.json holds the figures.
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

import torch

from backend_gpu.lora.ops import (
    Batched,
    SlotsOnHost,
    StepSlots,
    add_lora,
    add_lora_packed,
    group_rows,
)
from backend_gpu.lora.stacks import PackedA
from bench.options import DefaultsHelpFormatter

PROJECTIONS = {"qkv": [512, 256, 256], "gate_up": [1376, 1376]}


def calls(widths: list[int], slots: int, rank: int, hidden: int, seqs: int):
    """(each sub alone, all at once) over the same stacks, for one decode step."""
    groups = group_rows([i % slots for i in range(seqs)], [1] * seqs)
    batched = Batched.of(groups)
    step = StepSlots(kernels=False, idx=torch.empty(0), host_groups=groups, batched=batched)
    x, y = torch.randn(seqs, hidden), torch.zeros(seqs, sum(widths))
    packed = PackedA(hidden, len(widths), slots, rank, torch.float32, torch.device("cpu"))
    scale = torch.full((slots,), 2.0)
    host = SlotsOnHost([rank] * slots, [2.0] * slots)
    parts, start = [], 0
    for i, width in enumerate(widths):
        packed.view(i).copy_(torch.randn(slots, rank, hidden))
        parts.append((torch.randn(slots, width, rank), slice(start, start + width)))
        start += width

    def each() -> None:
        for i, (b, cols) in enumerate(parts):
            add_lora(y[:, cols], x, packed.view(i), b, scale, step, host)

    def at_once() -> None:
        add_lora_packed(y, x, packed.a, parts, scale, batched, rank)

    return each, at_once


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes")
    parser.add_argument("--number", type=int, default=50, help="calls per round")
    parser.add_argument("--repeat", type=int, default=15, help="rounds; the best counts")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    results = {}
    for name, widths in PROJECTIONS.items():
        each, at_once = calls(widths, slots=8, rank=16, hidden=512, seqs=16)
        t_each = best_us(each, args.number, args.repeat)
        t_once = best_us(at_once, args.number, args.repeat)
        results[name] = {"each_us": t_each, "at_once_us": t_once, "speedup": t_each / t_once}
        print(f"{name}: each sub {t_each:.1f} us, at once {t_once:.1f} us, {t_each / t_once:.2f}x")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_packed_shrink.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
