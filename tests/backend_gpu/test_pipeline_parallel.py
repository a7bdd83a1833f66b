"""Pipeline parallelism on this machine's CPU: stages as processes, hidden states sent
over gloo.

Greedy output over two stages (and over two stages of two tensor-parallel ranks each)
must be the single-rank output, under the near-tie rule (micro-batches change the
matmuls' shapes, so sums round a little differently), with chunked prefill and prefix
hits; each stage must hold only its layers and their KV cache; a stage that dies must
end in a clear error.
"""

from __future__ import annotations

import argparse
import os
import signal

import pytest
import torch
from transformers import AutoConfig

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from backend_gpu.loader import Checkpoint, build_model
from backend_gpu.pp_runner import micro_batches
from backend_gpu.pp_stages import WHOLE_MODEL, MissingLayer, Stage
from backend_gpu.scheduler import ScheduledBatch
from engine_api.errors import EngineDeadError
from gateway.backends import BackendSpec
from gateway.config_load import load_settings
from gateway.worker import cli as worker_cli
from gateway.worker_pool.placement import place_workers
from tests.backend_gpu.test_tensor_parallel import assert_same_greedy, prompts, reference

BUDGET = 1 << 20  # KV cache bytes per rank, the same for every engine here
# small chunks: prompts are prefilled over several steps, later chunks reading the cache
OPTIONS = {"max_num_batched_tokens": 16, "kv_cache_memory_bytes": BUDGET}


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """The ranks take the engine's thread count: one each here, so that four ranks do
    not fight over this machine's two cores (and tiny matmuls gain nothing from two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    """A tiny Qwen3 (its head tied to the embedding), its prompts and single-rank
    greedy reference, shared by this module's engines."""
    path = tiny_model_dir("qwen3")
    one = LLM(path, **OPTIONS)
    prompt_ids = prompts(one.tokenizer)
    return path, prompt_ids, reference(one, prompt_ids), one.engine.runner


@pytest.fixture(scope="module")
def two_stages(qwen3):
    """The model over two stages; the last test here kills a stage."""
    llm = LLM(qwen3[0], pipeline_parallel_size=2, **OPTIONS)
    yield llm
    llm.engine.close()


def test_two_stages_decode_what_one_does(qwen3, two_stages):
    _, prompt_ids, refs, single = qwen3
    assert_same_greedy(two_stages, refs, prompt_ids)
    # again: the shared prefix and the earlier prompts now come from the cache
    assert_same_greedy(two_stages, refs, prompt_ids)
    stats = two_stages.stats()
    assert stats.prefix_hits > 0 and stats.num_free_blocks == stats.num_blocks
    # the engine's process is the last stage: layer 1, the norm and the head (whose
    # weight is the embedding's table), and the KV cache of its one layer only, so the
    # same bytes hold twice the blocks
    runner = two_stages.engine.runner
    assert runner.stage == Stage(1, 2, 1, 2)
    assert isinstance(runner.model.model.layers[0], MissingLayer)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert runner.attention_layers == [runner.model.model.layers[1].self_attn]
    assert runner.num_blocks == 2 * single.num_blocks
    assert runner.kv_cache_bytes == single.kv_cache_bytes


def test_two_stages_of_two_ranks_each_decode_what_one_does(qwen3):
    """Four ranks: stage 0 is ranks 0 and 1, stage 1 ranks 2 (the engine) and 3; FP8
    weights, each stage quantizing its own layers (the embedding's table on stage 0, and
    again as the tied head on stage 1)."""
    path, prompt_ids, _, _ = qwen3
    fp8 = {**OPTIONS, "quantization": "fp8"}
    refs = reference(LLM(path, **fp8), prompt_ids)
    four = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, **fp8)
    assert_same_greedy(four, refs, prompt_ids)
    runner = four.engine.runner
    assert runner.ranks.rank_ids == [0, 1, 3] and runner.world.rank == 2
    assert runner.tp.size == 2 and runner.kv_shape == (1, 16)  # one of the 2 KV heads
    assert len(runner.attention_layers) == 1
    assert runner.model.lm_head.table is runner.model.model.embed_tokens
    four.engine.close()


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_each_stage_builds_and_reads_only_its_part(tiny_model_dir, arch):
    """An untied model of 2 layers (dense, or a mixture of experts: layers are layers):
    stage 0 holds the embedding and layer 0, stage 1 layer 1, the norm and the head,
    each with the checkpoint's values."""
    path = tiny_model_dir(arch)
    config = AutoConfig.from_pretrained(path)
    cpu = torch.device("cpu")

    def build(stage: Stage):
        return build_model(config, torch.float32, cpu, Checkpoint(path), "auto", 0, stage=stage)

    whole = build(WHOLE_MODEL)
    first, last = build(Stage.of(2, 2, 0)), build(Stage.of(2, 2, 1))
    assert first.lm_head is None and first.model.norm is None
    assert isinstance(first.model.layers[1], MissingLayer)
    assert last.model.embed_tokens is None and isinstance(last.model.layers[0], MissingLayer)
    expected = dict(whole.named_parameters())
    held = [*first.named_parameters(), *last.named_parameters()]
    assert sorted(name for name, _ in held) == sorted(expected)  # each tensor on one stage
    for name, param in held:
        assert torch.equal(param, expected[name]), name


def test_layers_split_into_contiguous_stages():
    assert [Stage.of(5, 2, i) for i in range(2)] == [Stage(0, 2, 0, 3), Stage(1, 2, 3, 5)]
    assert [(s.start, s.stop) for s in (Stage.of(4, 4, i) for i in range(4))] == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
    ]
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2"):
        Stage.of(2, 3, 0)


def test_micro_batches_are_contiguous_runs_even_in_tokens():
    decode = ScheduledBatch(list("abcdefgh"), [1] * 8)
    assert [(b.seqs, first) for b, first in micro_batches(decode, 2)] == [
        (list("abcd"), 0),
        (list("efgh"), 4),
    ]
    # a long prefill chunk alone, the decodes together
    mixed = ScheduledBatch(list("pabc"), [13, 1, 1, 1])
    assert [b.num_new_tokens for b, _ in micro_batches(mixed, 2)] == [[13], [1, 1, 1]]
    # more stages than sequences: one sequence each
    assert [b.seqs for b, _ in micro_batches(ScheduledBatch(["x", "y"], [5, 5]), 4)] == [
        ["x"],
        ["y"],
    ]
    # prompt logprobs' spans index the whole batch: it stays whole
    scored = ScheduledBatch(list("ab"), [4, 4], prompt_spans=[object()])
    assert micro_batches(scored, 2) == [(scored, 0)]


def test_what_stages_do_not_run_yet_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1"):
        EngineConfig(model="unused", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="does not work with enable_lora, kv_cache_dtype"):
        EngineConfig(
            model="unused", pipeline_parallel_size=2, enable_lora=True, kv_cache_dtype="fp8"
        )


def test_the_flag_and_the_variable_reach_the_engine():
    parser = argparse.ArgumentParser()
    worker_cli.add_engine_args(parser)  # the flags of `kvgate serve` and `kvgate worker`
    flags = ["--backend", "gpu", "--model", "m", "--pipeline-parallel-size", "2"]
    overrides = worker_cli.engine_overrides(parser.parse_args(flags))
    (spec,) = load_settings(None, overrides, environ={}).resolved_backends()
    assert spec.options == {"pipeline_parallel_size": 2}
    env = {"KVGATE_BACKEND": "gpu", "KVGATE_PIPELINE_PARALLEL_SIZE": "2"}
    (spec,) = load_settings(None, environ=env).resolved_backends()
    assert spec.options == {"pipeline_parallel_size": 2}
    # a supervised worker gets a device per rank: two stages of two ranks, four GPUs
    spec = BackendSpec("gpu", "gpu", "m", "", {"device": "cuda", "tensor_parallel_size": 2})
    spec.options["pipeline_parallel_size"] = 2
    placed = place_workers(spec, 2, [0, 1], [str(i) for i in range(8)])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placed] == ["0,1,2,3", "4,5,6,7"]


def test_a_stage_killed_mid_step_makes_the_engine_dead(two_stages):
    """Killed while the engine waits for its hidden states: gloo's socket closes, the
    step fails with the stage's exit code, and the engine stays dead. Last in this
    file: it kills the module's engine's first stage."""
    runner = two_stages.engine.runner
    (stage0,) = runner.ranks.procs
    load = runner.load

    def load_then_kill(step):
        os.kill(stage0.pid, signal.SIGKILL)  # the step's rows are already sent
        return load(step)

    runner.load = load_then_kill
    params = SamplingParams(temperature=0, max_tokens=4)
    dead = r"rank 0 \(pipeline stage 0, tensor-parallel rank 0\) exited with code -9"
    with pytest.raises(EngineDeadError, match=dead):
        two_stages.generate([[1, 5, 6, 7]], params)
    runner.load = load
    with pytest.raises(EngineDeadError, match=dead):  # seen before the next step
        two_stages.generate([[1, 5, 6, 7]], params)
    # and while idle: AsyncLLM's check every half second, which turns the gateway's
    # answers into 503s (as test_tensor_parallel shows for a tensor-parallel rank)
    with pytest.raises(EngineDeadError, match=dead):
        runner.check_alive()
