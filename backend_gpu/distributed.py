"""Tensor parallelism's process group: this rank, how many there are, and the three
collectives a Megatron-sharded model needs (an all-reduce after each row-parallel
matmul and after the vocabulary-split embedding, a gather of the vocabulary-split
logits to rank 0, and small reductions that make the ranks agree at start); and
pipeline parallelism's point-to-point send and receive of hidden states between stages,
over a second group of all the ranks (pp_stages.py).

Each engine makes its own group from its own TCP store, not torch.distributed's global
default group: one process may hold several engines (tests, in-process replicas), and a
group ends with its engine. gloo on the CPU, NCCL on CUDA. A collective whose peer died
fails rather than waits forever: gloo at once (the peer's socket closes), NCCL after
`timeout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# how long a collective may wait for a slow peer before it fails (a peer that died fails
# gloo's at once); generous, as the first steps on CUDA compile kernels
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass
class ParallelGroup:
    rank: int = 0
    size: int = 1
    pg: Any = None  # a torch.distributed ProcessGroup; None for a single rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            self.pg.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x joined along the last dimension, in rank order; the
        other ranks: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather([parts] if self.rank == 0 else [], [x], opts).wait()
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def send(self, x: torch.Tensor, dst: int) -> Any:
        """Start sending x to rank `dst` (pipeline parallel's hidden states); the caller
        waits on the returned work before x may change."""
        return self.pg.send([x], dst, 0)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fill x with what rank `src` sends, in send order."""
        self.pg.recv([x], src, 0).wait()
        return x

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `values` over the ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return self._reduce(values, dist.ReduceOp.SUM)

    def min_over_ranks(self, value: int) -> int:
        return int(self._reduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MIN)[0])

    def _reduce(self, values: torch.Tensor, op) -> torch.Tensor:
        """A reduced copy of `values`, on their device (NCCL reduces on the GPU)."""
        if self.size == 1:
            return values
        on_gpu = _is_nccl(self.pg) and values.device.type != "cuda"
        x = (
            values.to(torch.device("cuda", torch.cuda.current_device()))
            if on_gpu
            else values.clone()
        )
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([x], opts).wait()
        return x.to(values.device)


SINGLE = ParallelGroup()


def _is_nccl(pg) -> bool:
    return type(pg).__name__ == "ProcessGroupNCCL"


def join_group(store: dist.Store, rank: int, size: int, device: torch.device) -> ParallelGroup:
    """This rank's membership of the group of `size` ranks meeting at `store`: gloo on
    the CPU, NCCL on CUDA (this process's current device)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
    return ParallelGroup(rank, size, pg)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, or the r-th GPU from the configured
    one ("cuda" and "cuda:0" start at GPU 0, "cuda:2" at GPU 2)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)
