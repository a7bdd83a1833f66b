"""Tensor parallelism on this machine's CPU: two ranks, two processes, gloo.

Greedy output split over two ranks must be the single-device output (under the near-tie
rule: the row-parallel sums add in another order), with prefix caching, chunked
prefill, FP8 weights and KV cache and speculative decoding all on; each rank must hold
only its KV heads; a rank that dies must end in a clear error, not a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from backend_gpu.tp_shards import check_divisible
from engine_api.errors import EngineDeadError
from gateway.backends import BackendError, BackendSpec, GenRequest, build_backend
from gateway.config_load import load_settings
from gateway.worker import cli as worker_cli
from gateway.worker_pool.placement import place_workers
from tests.backend_gpu.conftest import GEMMA3_270M_GROUP
from tests.backend_gpu.reference import assert_greedy_matches
from tests.backend_gpu.tiny_models import SENTENCES, build_tokenizer, save_tiny_model
from tests.gateway.test_worker import start_worker

MAX_TOKENS = 12
# everything on: small chunks (chunked prefill, later chunks read the FP8 cache), FP8
# weights and cache, n-gram speculation; prefix caching is on by default
OPTIONS = {
    "max_num_batched_tokens": 16,
    "quantization": "fp8",
    "kv_cache_dtype": "fp8",
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    },
}


def prompts(tokenizer) -> list[list[int]]:
    """Two share a prefix of whole blocks; repeated text gives the n-gram proposer work."""
    shared = tokenizer.encode(" ".join(SENTENCES[:3]))
    return [
        shared + tokenizer.encode(SENTENCES[4]),
        shared + tokenizer.encode(SENTENCES[5]),
        tokenizer.encode(" ".join([SENTENCES[0]] * 3)),
    ]


def reference(llm: LLM, prompt_ids: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and, per step, the top two logits (as log-probabilities, whose gaps
    are the logits'), laid out as reference.assert_greedy_matches reads them."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    vocab = llm.engine.vocab_size
    refs = []
    for out in llm.generate(prompt_ids, params):
        logits = torch.full((len(out.token_ids), vocab), float("-inf"))
        for step, lp in enumerate(out.logprobs):
            for token, value in lp.top:
                logits[step, token] = value
        refs.append((out.token_ids, logits))
    return refs


def assert_same_greedy(tp2: LLM, refs, prompt_ids) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for out, (ref_ids, ref_logits) in zip(tp2.generate(prompt_ids, params), refs, strict=True):
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_two_ranks_decode_what_one_does(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    one = LLM(path, **OPTIONS)
    prompt_ids = prompts(one.tokenizer)
    refs = reference(one, prompt_ids)
    two = LLM(path, tensor_parallel_size=2, **OPTIONS)
    assert_same_greedy(two, refs, prompt_ids)
    # again: the shared prefix and the earlier prompts now come from the cache
    assert_same_greedy(two, refs, prompt_ids)
    stats = two.stats()
    assert stats.prefix_hits > 0 and stats.num_drafts > 0
    assert stats.num_free_blocks == stats.num_blocks
    # rank 0's shard: half the heads, FP8 scales agreed over both ranks' heads (later
    # layers' inputs come through row-parallel sums, which round a little differently)
    runner = two.engine.runner
    attn = runner.attention_layers[0]
    assert attn.num_heads == 2 and attn.num_kv_heads == 1
    assert attn.k_cache.dtype == torch.float8_e4m3fn
    scales = [s for a in runner.attention_layers for s in (a.k_scale, a.v_scale)]
    single = [s for a in one.engine.runner.attention_layers for s in (a.k_scale, a.v_scale)]
    assert scales[:2] == single[:2] and scales == pytest.approx(single, rel=1e-5)


def test_a_draft_model_runs_whole_beside_rank_zero(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    one = LLM(path)
    prompt_ids = prompts(one.tokenizer)
    refs = reference(one, prompt_ids)
    draft = {"method": "draft", "model": tiny_model_dir("qwen3"), "num_speculative_tokens": 3}
    two = LLM(path, tensor_parallel_size=2, speculative_config=draft)
    assert_same_greedy(two, refs, prompt_ids)
    assert two.stats().num_accepted_tokens > 0  # the target itself as its draft
    draft_runner = two.engine.speculator.proposer.runner
    assert draft_runner.ranks is None and draft_runner.kv_shape == (2, 16)


def test_each_rank_holds_only_its_kv_heads(tiny_model_dir):
    """The same bytes per rank hold twice the blocks: each rank caches one of the two KV
    heads (and the ranks agree on the count, so rank 1's pool is as large)."""
    path = tiny_model_dir("llama")
    budget = 1 << 20
    one = LLM(path, kv_cache_memory_bytes=budget).engine.runner
    two = LLM(path, kv_cache_memory_bytes=budget, tensor_parallel_size=2).engine.runner
    assert one.kv_shape == (2, 16) and two.kv_shape == (1, 16)
    assert two.attention_layers[0].k_cache.shape[1:] == (1, 16)
    assert two.num_blocks == 2 * one.num_blocks
    assert two.kv_cache_bytes == one.kv_cache_bytes


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory) -> str:
    """A Llama with a single KV head (replicated on both ranks) and an odd vocabulary
    (split into two shards of 192 rows, the last one padded: its logit is cut)."""
    path = str(tmp_path_factory.mktemp("tp") / "tiny-llama-1kv")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=383,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_a_single_kv_head_is_replicated_and_the_vocabulary_padded(one_kv_head_model):
    budget = 1 << 20
    one = LLM(one_kv_head_model, kv_cache_memory_bytes=budget)
    prompt_ids = prompts(one.tokenizer)
    refs = reference(one, prompt_ids)
    two = LLM(one_kv_head_model, kv_cache_memory_bytes=budget, tensor_parallel_size=2)
    assert_same_greedy(two, refs, prompt_ids)
    runner = two.engine.runner
    assert runner.kv_shape == (1, 16) and runner.num_blocks == one.engine.runner.num_blocks
    # rank 0 holds the first 192 rows; rank 1 the other 191 and a zero row
    head = one.engine.runner.model.lm_head.weight
    assert torch.equal(runner.model.lm_head.weight, head[:192])


def test_sizes_that_do_not_split_the_model_are_refused(tiny_model_dir):
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    with pytest.raises(ValueError, match="does not divide its 4 attention heads"):
        check_divisible(config, 3)
    check_divisible(config, 4)  # 2 KV heads over 4 ranks: each replicated on two
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(model="unused", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="does not divide"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=3)


def test_a_rank_that_dies_makes_the_engine_dead(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert len(llm.generate([[1, 5, 6, 7]], params)[0].token_ids) == 4
    (rank1,) = llm.engine.runner.ranks.procs
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.join(10)
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited with code -9"):
        llm.generate([[1, 5, 6, 7]], params)


def test_a_rank_killed_mid_step_ends_the_step_with_the_error(tiny_model_dir):
    """Killed while rank 0 waits in a collective: gloo's socket closes, the step fails."""
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=2)
    runner = llm.engine.runner
    (rank1,) = runner.ranks.procs
    load = runner.load

    def load_then_kill(step):
        os.kill(rank1.pid, signal.SIGKILL)  # rank 1 already has the step
        return load(step)

    runner.load = load_then_kill
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited with code -9"):
        llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))


async def test_gateway_reports_a_dead_rank_as_unavailable(tiny_model_dir):
    parser = argparse.ArgumentParser()
    worker_cli.add_engine_args(parser)  # the flags of `kvgate serve` and `kvgate worker`
    flags = ["--backend", "gpu", "--model", tiny_model_dir("llama"), "--tensor-parallel-size"]
    overrides = worker_cli.engine_overrides(parser.parse_args([*flags, "2"]))
    env = {"KVGATE_BACKEND": "gpu", "KVGATE_TENSOR_PARALLEL_SIZE": "2"}
    assert load_settings(None, environ=env).resolved_backends()[0].options == {
        "tensor_parallel_size": 2
    }
    (spec,) = load_settings(None, overrides, environ={}).resolved_backends()
    assert spec.options == {"tensor_parallel_size": 2}
    backend = build_backend(spec)
    await backend.start()
    try:
        req = GenRequest(
            request_id="r1",
            model="tiny-llama",
            prompt_token_ids=[1, *range(5, 25)],  # one full block: stored, an event
            sampling=SamplingParams(temperature=0, max_tokens=3),
        )
        chunks = [c async for c in backend.generate(req)]
        assert chunks[-1].finish_reason == "length"
        assert backend.kv_events()  # the prefix catalog's feed works under TP too
        # leaving a stream early aborts its request and frees its blocks
        long = dataclasses.replace(req, request_id="r2", sampling=SamplingParams(max_tokens=200))
        stream = backend.generate(long)
        await anext(stream)
        await stream.aclose()
        for _ in range(100):  # the engine thread applies the abort between steps
            if (stats := backend.stats()).running == 0:
                break
            await asyncio.sleep(0.05)
        assert stats.running == 0 and stats.extra["num_free_blocks"] == stats.extra["num_blocks"]
        (rank1,) = backend.engine.engine.runner.ranks.procs
        os.kill(rank1.pid, signal.SIGKILL)
        # the idle engine notices within its next check (every half second)
        for _ in range(100):
            if not backend.stats().healthy:
                break
            await asyncio.sleep(0.05)
        assert not backend.stats().healthy
        with pytest.raises(BackendError, match="rank 1 exited"):
            [c async for c in backend.generate(req)]
    finally:
        await backend.stop(drain=False)


def spawned_children(pid: int) -> list[int]:
    """Processes `pid` started with multiprocessing's spawn (its tensor-parallel ranks),
    from any of its threads (the engine starts in a worker thread)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    ranks = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                ranks.append(child)
    return ranks


def test_a_worker_whose_rank_dies_exits_for_its_supervisor_to_restart(tmp_path):
    model = save_tiny_model("llama", str(tmp_path))
    w = start_worker(tmp_path, "--backend", "gpu", "--model", model, "--tensor-parallel-size", "2")
    try:
        (rank1,) = spawned_children(w.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert w.proc.wait(timeout=60) == 1
        assert "the engine died" in w.log.read_text()
        assert "tensor-parallel rank 1 exited with code -9" in w.log.read_text()
    finally:
        w.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold start converts the GGUF first (cached afterwards)
@GEMMA3_270M_GROUP
def test_gemma3_270m_gguf_over_two_ranks_decodes_what_one_does(gemma3_270m):
    """The real default model: GGUF read per tensor and per rank, its one KV head
    replicated, its 262k vocabulary split."""
    from gateway.backends.default_model import default_model_path

    one = gemma3_270m
    prompt_ids = [one.tokenizer.encode(p) for p in ("The capital of France is", "def f(n):")]
    refs = reference(one, prompt_ids)
    options = {"kv_cache_memory_bytes": 16 << 20, "max_model_len": 448}  # as the one rank's
    two = LLM(str(default_model_path()), tensor_parallel_size=2, **options)
    assert two.engine.runner.kv_shape == (1, 256)
    assert_same_greedy(two, refs, prompt_ids)


def test_supervised_workers_get_their_ranks_devices():
    spec = BackendSpec("gpu", "gpu", "m", "", {"device": "cuda", "tensor_parallel_size": 2})
    placed = place_workers(spec, 2, [0, 1, 2, 3], ["0", "1", "2", "3"])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placed] == ["0,1", "2,3"]
    on_cpu = BackendSpec("gpu", "gpu", "m", "", {"tensor_parallel_size": 2})
    placed = place_workers(on_cpu, 1, [0, 1, 2, 3], [])
    assert placed[0].cpus == [0, 1, 2, 3] and placed[0].env["OMP_NUM_THREADS"] == "2"
