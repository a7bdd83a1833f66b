"""Tensor-parallel ranks as processes: rank 0 is the engine's own process (scheduler,
sampler, its shard of the model); ranks 1..N-1 are spawned here, each loading only its
own shard, and then only run the model on the steps rank 0 hands them.

Each step's rows (rank_handoff.StepRows: token ids, block tables, lengths, sampled rows)
go from rank 0 down one pipe per rank, as nano-vllm's shared-memory broadcast and vLLM's
message queue do; the model's own traffic (all-reduces, the logits' gather) goes over
the torch.distributed group (distributed.py). A rank only ever waits on its pipe or on
a collective, so it leaves when rank 0 goes (the pipe ends, or a collective fails), and
rank 0 learns that a rank died from the failed collective or from its exit code,
checked before each step and while idle: the engine then reports itself dead with the
rank and its exit code, rather than hanging.

Under pipeline parallelism there are pipeline_parallel_size x tensor_parallel_size
ranks, numbered stage by stage (rank = stage * tp_size + tp_rank, pp_stages.py), and
the engine's process is the last stage's tensor-parallel rank 0 (it samples,
pp_runner.py); every rank joins the group of all ranks (hidden states go stage to
stage over it) and its stage's tensor-parallel group, each over its own prefix of the
store.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from backend_gpu.config import EngineConfig
from backend_gpu.distributed import SINGLE, ParallelGroup, join_group, rank_device
from backend_gpu.expert_shards import MoEConfig, check_experts_divisible
from backend_gpu.loader import Checkpoint
from backend_gpu.model_runner import ModelRunner
from backend_gpu.pp_runner import PipelineRunner
from backend_gpu.pp_stages import WHOLE_MODEL, Stage, check_stages, stage_of_rank
from backend_gpu.rank_handoff import LoRASlot, StepRows
from backend_gpu.tp_shards import check_divisible
from engine_api.errors import EngineDeadError

# how long the ranks may take to start (import torch, read the config) and meet
START_TIMEOUT = timedelta(minutes=5)
STOP_WAIT_S = 5.0  # a rank told to stop gets this long before it is terminated


def start_runner(config: EngineConfig, hf_config, checkpoint: Checkpoint, tokenizer) -> ModelRunner:
    """The engine's model runner; under tensor or pipeline parallelism the other ranks
    start first."""
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return ModelRunner(config, hf_config, checkpoint, tokenizer)
    check_divisible(hf_config, config.tensor_parallel_size)
    check_stages(hf_config.num_hidden_layers, config.pipeline_parallel_size)
    if (moe := MoEConfig.of(hf_config)) is not None:
        check_experts_divisible(moe, config.tensor_parallel_size, config.enable_expert_parallel)
    ranks = RankProcesses(config, hf_config, checkpoint, tokenizer)
    try:
        return rank_runner(config, hf_config, checkpoint, tokenizer, ranks.groups, ranks)
    except RuntimeError as exc:  # a collective failed while loading: a rank died starting
        failure = ranks.failure(exc)
        ranks.close()
        raise failure from exc
    except BaseException:
        ranks.close()
        raise


@dataclass(frozen=True)
class RankGroups:
    """A rank's groups: its stage's tensor-parallel group, the group of every rank
    (None without pipeline parallelism: then the tensor-parallel group is all), and
    its stage."""

    tp: ParallelGroup
    world: ParallelGroup | None
    stage: Stage


def join_groups(store: dist.Store, rank: int, config: EngineConfig, num_layers: int) -> RankGroups:
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    device = rank_device(config.device, rank)
    if pp_size == 1:
        return RankGroups(join_group(store, rank, tp_size, device), None, WHOLE_MODEL)
    # every rank joins the same groups in the same order: each waits for all its members
    world = join_group(dist.PrefixStore("world", store), rank, tp_size * pp_size, device)
    stage, tp_rank = stage_of_rank(rank, tp_size)
    tp = SINGLE
    if tp_size > 1:
        tp = join_group(dist.PrefixStore(f"stage-{stage}", store), tp_rank, tp_size, device)
    return RankGroups(tp, world, Stage.of(num_layers, pp_size, stage))


def rank_runner(
    config: EngineConfig,
    hf_config,
    checkpoint: Checkpoint,
    tokenizer,
    groups: RankGroups,
    ranks: RankProcesses | None = None,
) -> ModelRunner:
    """A rank's runner over its part of the model (`ranks`: the engine's handle on the
    other ranks, on the engine's own rank)."""
    if groups.stage.count == 1:
        return ModelRunner(config, hf_config, checkpoint, tokenizer, groups.tp, ranks)
    return PipelineRunner(
        config, hf_config, checkpoint, tokenizer, groups.tp, ranks, groups.stage, groups.world
    )


def engine_rank(config: EngineConfig) -> int:
    """The rank of the engine's own process: the last stage's tensor-parallel rank 0."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def rank_name(config: EngineConfig, rank: int) -> str:
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    stage, tp_rank = stage_of_rank(rank, config.tensor_parallel_size)
    return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


class RankProcesses:
    """The engine's handle on the other ranks: their processes, their pipes, the
    engine's own groups."""

    def __init__(self, config: EngineConfig, hf_config, checkpoint: Checkpoint, tokenizer) -> None:
        size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.config = config
        own = engine_rank(config)
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn everywhere alike
        # the engine hosts the store the ranks meet at (port 0: any free one)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=START_TIMEOUT, wait_for_workers=False
        )
        self.procs: list[mp.Process] = []
        self.rank_ids = [rank for rank in range(size) if rank != own]
        self.pipes = []
        for rank in self.rank_ids:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, self.store.port, config, hf_config, checkpoint, tokenizer, reader),
                kwargs={"threads": torch.get_num_threads()},
                name=f"kvgate-tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            reader.close()
            self.procs.append(proc)
            self.pipes.append(writer)
        # stops the ranks when the engine is dropped or the process exits
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.pipes)
        try:
            self._await_ranks()
            self.groups = join_groups(self.store, own, config, hf_config.num_hidden_layers)
        except BaseException:
            self.close()
            raise

    def _await_ranks(self) -> None:
        """Wait until every rank is about to join, watching that none died starting
        (the group's own rendezvous would wait out its whole timeout for it)."""
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        for rank, proc in zip(self.rank_ids, self.procs, strict=True):
            while not self.store.check([_ready_key(rank)]):
                if not proc.is_alive():
                    raise EngineDeadError(
                        f"{rank_name(self.config, rank)} exited with code {proc.exitcode} "
                        "while starting (its error is in the log above)"
                    )
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"{rank_name(self.config, rank)} did not start within {START_TIMEOUT}"
                    )
                time.sleep(0.05)

    def send(self, step: StepRows | LoRASlot | list[StepRows]) -> None:
        """Hand a step (or a LoRA slot's weights) to every other rank; EngineDeadError if
        one is gone."""
        self.check()
        try:
            for pipe in self.pipes:
                pipe.send(step)
        except OSError as exc:  # the pipe broke: its rank is gone
            raise self.failure(exc) from exc

    def check(self) -> None:
        """Raise EngineDeadError if a rank has exited."""
        for rank, proc in zip(self.rank_ids, self.procs, strict=True):
            if proc.exitcode is not None:
                raise EngineDeadError(
                    f"{rank_name(self.config, rank)} exited with code {proc.exitcode}; "
                    "the engine cannot run without it"
                )

    def failure(self, exc: BaseException) -> EngineDeadError:
        """The error to report for a failed collective or pipe: which rank exited and
        how, if one did (a rank killed mid-step is reaped within a moment)."""
        for _ in range(20):
            for rank, proc in zip(self.rank_ids, self.procs, strict=True):
                if proc.exitcode is not None:
                    return EngineDeadError(
                        f"{rank_name(self.config, rank)} exited with code {proc.exitcode}: {exc}"
                    )
            time.sleep(0.05)
        return EngineDeadError(f"tensor-parallel step failed: {exc}")

    def close(self) -> None:
        self._finalizer()


def _stop(procs: list[mp.Process], pipes: list) -> None:
    for pipe in pipes:
        with contextlib.suppress(OSError):
            pipe.send(None)  # stop after the current step
        pipe.close()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join()


def _ready_key(rank: int) -> str:
    return f"kvgate-tp-ready-{rank}"


def _rank_main(
    rank: int,
    port: int,
    config: EngineConfig,
    hf_config,
    checkpoint: Checkpoint,
    tokenizer,
    steps,
    threads: int,
) -> None:
    """A rank other than the engine's: join the groups, load this rank's part, then run
    each step the engine hands over until it says stop or is gone."""
    # Ctrl-C reaches the whole process group: rank 0 decides, this rank follows its pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)  # as many as rank 0 runs
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=START_TIMEOUT)
    store.set(_ready_key(rank), "1")
    groups = join_groups(store, rank, config, hf_config.num_hidden_layers)
    runner = rank_runner(config, hf_config, checkpoint, tokenizer, groups)
    while True:
        try:
            step = steps.recv()
        except EOFError:  # rank 0 is gone
            return
        if step is None:
            return
        if isinstance(step, LoRASlot):
            runner.write_lora(step.slot, step.weights)
        else:
            runner.execute(step)
