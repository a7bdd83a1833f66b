"""Tensor-parallel ranks as processes: rank 0 is the engine's own process (scheduler,
sampler, its shard of the model); ranks 1..N-1 are spawned here, each loading only its
own shard, and then only run the model on the steps rank 0 hands them.

Each step's rows (step_buffers.StepRows: token ids, block tables, lengths, sampled rows)
go from rank 0 down one pipe per rank, as nano-vllm's shared-memory broadcast and vLLM's
message queue do; the model's own traffic (all-reduces, the logits' gather) goes over
the torch.distributed group (distributed.py). A rank only ever waits on its pipe or on
a collective, so it leaves when rank 0 goes (the pipe ends, or a collective fails), and
rank 0 learns that a rank died from the failed collective or from its exit code,
checked before each step and while idle: the engine then reports itself dead with the
rank and its exit code, rather than hanging.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from backend_gpu.config import EngineConfig
from backend_gpu.distributed import join_group, rank_device
from backend_gpu.expert_shards import MoEConfig, check_experts_divisible
from backend_gpu.loader import Checkpoint
from backend_gpu.model_runner import LoRASlot, ModelRunner
from backend_gpu.step_buffers import StepRows
from backend_gpu.tp_shards import check_divisible
from engine_api.errors import EngineDeadError

# how long the ranks may take to start (import torch, read the config) and meet
START_TIMEOUT = timedelta(minutes=5)
STOP_WAIT_S = 5.0  # a rank told to stop gets this long before it is terminated


def start_runner(config: EngineConfig, hf_config, checkpoint: Checkpoint, tokenizer) -> ModelRunner:
    """Rank 0's model runner; under tensor parallelism the other ranks start first."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, hf_config, checkpoint, tokenizer)
    check_divisible(hf_config, config.tensor_parallel_size)
    if (moe := MoEConfig.of(hf_config)) is not None:
        check_experts_divisible(moe, config.tensor_parallel_size, config.enable_expert_parallel)
    ranks = RankProcesses(config, hf_config, checkpoint, tokenizer)
    try:
        return ModelRunner(config, hf_config, checkpoint, tokenizer, ranks.group, ranks)
    except RuntimeError as exc:  # a collective failed while loading: a rank died starting
        failure = ranks.failure(exc)
        ranks.close()
        raise failure from exc
    except BaseException:
        ranks.close()
        raise


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: their processes, their pipes, the group."""

    def __init__(self, config: EngineConfig, hf_config, checkpoint: Checkpoint, tokenizer) -> None:
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn everywhere alike
        # rank 0 hosts the store the ranks meet at (port 0: any free one)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=START_TIMEOUT, wait_for_workers=False
        )
        self.procs: list[mp.Process] = []
        self.pipes = []
        for rank in range(1, size):
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
            self.group = join_group(self.store, 0, size, rank_device(config.device, 0))
        except BaseException:
            self.close()
            raise

    def _await_ranks(self) -> None:
        """Wait until every rank is about to join, watching that none died starting
        (the group's own rendezvous would wait out its whole timeout for it)."""
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        for rank, proc in enumerate(self.procs, start=1):
            while not self.store.check([_ready_key(rank)]):
                if not proc.is_alive():
                    raise EngineDeadError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode} "
                        "while starting (its error is in the log above)"
                    )
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"tensor-parallel rank {rank} did not start within {START_TIMEOUT}"
                    )
                time.sleep(0.05)

    def send(self, step: StepRows | LoRASlot) -> None:
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
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                raise EngineDeadError(
                    f"tensor-parallel rank {rank} exited with code {proc.exitcode}; "
                    "the engine cannot run without it"
                )

    def failure(self, exc: BaseException) -> EngineDeadError:
        """The error to report for a failed collective or pipe: which rank exited and
        how, if one did (a rank killed mid-step is reaped within a moment)."""
        for _ in range(20):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    return EngineDeadError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode}: {exc}"
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
    """A rank other than 0: join the group, load this rank's shard, then run each step
    rank 0 hands over until it says stop or is gone."""
    # Ctrl-C reaches the whole process group: rank 0 decides, this rank follows its pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)  # as many as rank 0 runs
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=START_TIMEOUT)
    store.set(_ready_key(rank), "1")
    group = join_group(store, rank, size, rank_device(config.device, rank))
    runner = ModelRunner(config, hf_config, checkpoint, tokenizer, group)
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
