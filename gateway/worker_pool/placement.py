"""Where each supervised worker runs. With CUDA and several GPUs: one GPU each (a
worker sees only its own, as `cuda`), or tensor_parallel_size GPUs each for an engine
split over several. Otherwise the cores are split between the workers, each pinned to
its share and told to run as many threads as it has, divided between its
tensor-parallel ranks: two engines each assuming the whole machine would fight over
every core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gateway.backends import BackendSpec


@dataclass(frozen=True)
class Placement:
    env: dict[str, str] = field(default_factory=dict)  # added to the worker's environment
    options: dict[str, Any] = field(default_factory=dict)  # added to its engine options
    cpus: list[int] | None = None  # the cores it is pinned to; None: not pinned


def place_workers(spec: BackendSpec, n: int, cpus: list[int], gpus: list[str]) -> list[Placement]:
    """`cpus`: the cores this process may use; `gpus`: the CUDA devices it sees, as
    CUDA_VISIBLE_DEVICES names them (indexes or UUIDs)."""
    if uses_cuda(spec) and len(gpus) > 1:
        tp = _tensor_parallel_size(spec)
        return [
            Placement(
                env={
                    "CUDA_VISIBLE_DEVICES": ",".join(
                        gpus[(i * tp + r) % len(gpus)] for r in range(tp)
                    )
                },
                options={"device": "cuda"},
            )
            for i in range(n)
        ]
    return [_on_cores(spec, share) for share in split_cores(cpus, n)]


def split_cores(cpus: list[int], n: int) -> list[list[int]]:
    """`n` contiguous shares as even as can be; with fewer cores than workers, one core
    each, shared in turn."""
    if n >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(n)]
    size, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        shares.append(cpus[start:end])
        start = end
    return shares


def _on_cores(spec: BackendSpec, share: list[int]) -> Placement:
    threads = str(len(share))
    if spec.type == "local" and "n_threads" not in spec.options:  # as configured, else its share
        return Placement(options={"n_threads": len(share)}, cpus=share)
    if spec.type == "gpu":  # torch sizes its CPU thread pool from OMP_NUM_THREADS
        threads = str(max(1, len(share) // _tensor_parallel_size(spec)))  # per rank
        return Placement(env={"OMP_NUM_THREADS": threads}, cpus=share)
    return Placement(cpus=share)


def _tensor_parallel_size(spec: BackendSpec) -> int:
    """Ranks (processes, devices) an engine of `spec` runs: tensor x pipeline parallel."""
    options = spec.options
    return int(options.get("tensor_parallel_size", 1)) * int(
        options.get("pipeline_parallel_size", 1)
    )


def uses_cuda(spec: BackendSpec) -> bool:
    return spec.type == "gpu" and str(spec.options.get("device", "cpu")).startswith("cuda")


def visible_gpus(spec: BackendSpec) -> list[str]:
    """The CUDA devices a gpu worker could be given (none unless the spec runs on CUDA)."""
    if not uses_cuda(spec):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch  # the gpu backend's own dependency: only asked when it is used

    return [str(i) for i in range(torch.cuda.device_count())]
