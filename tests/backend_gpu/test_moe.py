"""Mixture-of-experts models (Mixtral, Qwen3-MoE) on tiny random checkpoints: greedy
output equal to transformers' with chunked prefill and prefix hits; each sparse layer's
router picks the experts transformers' router picks, with its weights, and the experts
sorted by expert compute transformers' block output; the grouped torch paths (one bmm,
or a matmul per expert) equal the loop over experts, 8-bit experts included; expert
parallel over two ranks equals one rank while each rank holds half the experts."""

from __future__ import annotations

import pytest
import torch

from backend_gpu import LLM, SamplingParams
from backend_gpu.distributed import ParallelGroup
from backend_gpu.expert_shards import (
    ExpertCheckpointShards,
    ExpertShard,
    MoEConfig,
    check_experts_divisible,
)
from backend_gpu.layers.moe import FusedExperts, grouped_experts, loop_over_experts
from backend_gpu.tp_shards import SKIP, ShardRead
from gateway.backends.gpu import ENGINE_OPTIONS
from gateway.cli.main import build_parser
from gateway.config_load import load_settings
from gateway.worker import cli as worker_cli
from tests.backend_gpu.reference import (
    chunked_engines,
    forced_agreement,
    greedy_checker,
    hf_sparse_blocks,
)
from tests.backend_gpu.test_correctness import mixed_prompts

ARCHS = ["mixtral", "qwen3_moe"]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts() -> list[list[int]]:
    """17 tokens, and two of 43 and 42 sharing 40 (two full blocks to hit)."""
    return [mixed_prompts()[i] for i in (1, 5, 6)]


@pytest.fixture(scope="module")
def check(tiny_model_dir):
    """check(llm, arch): greedy outputs equal transformers' (computed once per arch)."""
    return greedy_checker(tiny_model_dir, prompts(), GREEDY)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return chunked_engines(tiny_model_dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(engines, check, arch):
    llm = engines(arch)
    check(llm, arch)
    outs = check(llm, arch)  # again: the prompts' full blocks are cached
    assert llm.stats().prefix_hits > 0 and outs[-1].num_cached_tokens >= 32


@pytest.mark.parametrize("arch", ARCHS)
def test_router_picks_transformers_experts(tiny_model_dir, engines, arch):
    prompt = mixed_prompts()[4]
    hf = hf_sparse_blocks(tiny_model_dir(arch), prompt)
    ours = [layer.mlp for layer in engines(arch).engine.runner.model.model.layers]
    ours = [block for block in ours if hasattr(block, "experts")]
    assert len(ours) == len(hf) == (2 if arch == "mixtral" else 1)  # Qwen's layer 1 is dense
    for block, ref in zip(ours, hf, strict=True):
        x = ref["x"].reshape(-1, ref["x"].shape[-1])
        ref_logits, ref_weights, ref_ids = ref["gate"]
        with torch.inference_mode():
            weights, ids = block.gate(x)
            out = block.experts(x, weights, ids)
        torch.testing.assert_close(x @ block.gate.weight.T.detach(), ref_logits)
        # the same experts for every token, each with its weight (top-k order aside)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
        ours_by_expert = weights.gather(-1, ids.argsort(-1))
        torch.testing.assert_close(ours_by_expert, ref_weights.gather(-1, ref_ids.argsort(-1)))
        assert len(ids.unique()) > 1  # the prompt spreads over experts
        torch.testing.assert_close(out, ref["out"].reshape(out.shape), rtol=1e-5, atol=1e-5)


def random_experts(shard: ExpertShard, hidden: int = 32, seed: int = 0) -> FusedExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(hidden, shard, ("w1", "w3", "w2"))
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return experts


def routing(tokens: int, num_experts: int, k: int, skew: bool, seed: int = 1):
    """(float32 weights, ids) [tokens, k]: distinct experts per token; `skew`: most
    tokens on experts 0 and 1, so the runs differ in length."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=gen)
    if skew:
        scores[: tokens * 3 // 4, :2] += 1
    weights, ids = scores.topk(k, dim=-1)
    return weights.softmax(-1), ids


MOE8 = MoEConfig(8, 2, 48, True, ("w1", "w3", "w2"), frozenset({0}))


@pytest.mark.parametrize("tokens,skew", [(1, False), (16, False), (64, True)])
@pytest.mark.parametrize("expert_parallel_rank", [None, 1])
@pytest.mark.parametrize("method", [None, "fp8"])
def test_grouped_paths_equal_the_loop_over_experts(tokens, skew, expert_parallel_rank, method):
    """16 balanced tokens take the one-bmm path, 64 skewed ones a matmul per expert; as
    rank 1 of 2 under expert parallel, only experts 4..7 are computed here."""
    if expert_parallel_rank is None:
        shard = ExpertShard.of(MOE8, ParallelGroup(), False)
    else:
        shard = ExpertShard.of(MOE8, ParallelGroup(expert_parallel_rank, 2), True)
    experts = random_experts(shard)
    if method is not None:
        experts.quantize(method, ParallelGroup())
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(tokens, 8, 2, skew)
    want = loop_over_experts(experts, x, weights, ids)
    torch.testing.assert_close(grouped_experts(experts, x, weights, ids), want)
    if expert_parallel_rank is not None:  # tokens only on experts 0..3 get nothing here
        assert not want[(ids < 4).all(dim=1)].any()


def test_fp8_experts_within_tolerance_of_the_originals():
    experts = random_experts(ExpertShard.of(MOE8, ParallelGroup(), False))
    original = experts.gate_up_proj.detach().clone()
    experts.quantize("fp8", ParallelGroup())
    widened = experts.gate_up_proj.float() * experts.gate_up_scale[..., None]
    assert experts.gate_up_scale.shape == (8, 96) and experts.down_scale.shape == (8, 32)
    assert (widened - original).norm() / original.norm() < 0.05


def test_fp8_engine_agrees_with_the_unquantized_model(tiny_model_dir, engines):
    prompt_ids = mixed_prompts()[:4]
    refs = engines("mixtral").generate(prompt_ids, SamplingParams(temperature=0, max_tokens=8))
    llm = LLM(tiny_model_dir("mixtral"), quantization="fp8", max_num_batched_tokens=24)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert llm.engine.runner.model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    # routing amplifies rounding: a token whose top-2 changes takes other experts (the
    # FP8 experts alone agree on 0.91 of these tokens; with FP8 attention too, 0.66)
    assert forced_agreement(llm, prompt_ids, refs) >= 0.6


def test_each_rank_reads_only_its_experts():
    ep = ExpertShard.of(MOE8, ParallelGroup(1, 2), True)
    sliced = ExpertShard.of(MOE8, ParallelGroup(1, 2), False)
    dense = lambda name: ShardRead(0, 0, 1)  # noqa: E731 (what the dense cut says)
    ep_reads, sliced_reads = (ExpertCheckpointShards(MOE8, shard, dense) for shard in (ep, sliced))
    name = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    assert ep_reads(name.format(3, "w1")) is SKIP  # rank 1 holds experts 4..7
    assert ep_reads(name.format(5, "w2")) is None  # whole
    assert sliced_reads(name.format(3, "w1")) == ShardRead(0, 24, 48)  # its intermediate rows
    assert sliced_reads(name.format(3, "w2")) == ShardRead(1, 24, 48)  # down: its columns
    assert ep_reads("model.layers.0.block_sparse_moe.gate.weight") == ShardRead(0, 0, 1)


def test_expert_counts_must_divide():
    with pytest.raises(ValueError, match="does not divide the model's 8 experts"):
        check_experts_divisible(MOE8, 3, expert_parallel=True)
    with pytest.raises(ValueError, match="experts' intermediate size 48"):
        check_experts_divisible(MOE8, 5, expert_parallel=False)
    check_experts_divisible(MOE8, 4, expert_parallel=True)


def test_expert_parallel_needs_a_moe_model(tiny_model_dir):
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(tiny_model_dir("llama"), enable_expert_parallel=True)


def test_expert_parallel_over_two_ranks_matches_transformers(tiny_model_dir, check):
    """Two processes over gloo, each holding 2 of Mixtral's 4 experts whole."""
    llm = LLM(
        tiny_model_dir("mixtral"),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        max_num_batched_tokens=24,
    )
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 2 and experts.shard.first == 0
    check(llm, "mixtral")


def test_experts_cut_over_two_ranks_sum_to_the_whole():
    """Plain tensor parallel: each rank's slice of every expert (its checkpoint reads
    applied to the whole tensors) gives a partial output; the two add up to the whole."""
    whole = random_experts(ExpertShard.of(MOE8, ParallelGroup(), False))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(16, 8, 2, skew=False)
    partial_sum = torch.zeros_like(x)
    for rank in range(2):
        shard = ExpertShard.of(MOE8, ParallelGroup(rank, 2), False)
        reads = ExpertCheckpointShards(MOE8, shard, lambda name: None)
        part = FusedExperts(32, shard, MOE8.leaves)
        for e in range(8):
            gate_up, down = whole.gate_up_proj[e].detach(), whole.down_proj[e]
            tensors = {"w1": gate_up[:48], "w3": gate_up[48:], "w2": down.detach()}
            for leaf, tensor in tensors.items():
                read = reads(f"model.layers.0.mlp.experts.{e}.{leaf}.weight")
                index = [slice(None), slice(None)]
                index[read.dim] = slice(read.start, read.stop)
                part.load_expert(e, leaf, tensor[tuple(index)])
        partial_sum += grouped_experts(part, x, weights, ids)
    torch.testing.assert_close(partial_sum, grouped_experts(whole, x, weights, ids))


def test_the_flag_reaches_the_gpu_engine_options():
    args = build_parser().parse_args(
        ["worker", "--backend", "gpu", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    )
    (spec,) = load_settings(None, worker_cli.engine_overrides(args), environ={}).resolved_backends()
    assert spec.options == {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    env = {"KVGATE_BACKEND": "gpu", "KVGATE_ENABLE_EXPERT_PARALLEL": "true"}
    (spec,) = load_settings(None, environ=env).resolved_backends()
    assert spec.options == {"enable_expert_parallel": True}
    assert "enable_expert_parallel" in ENGINE_OPTIONS  # the gpu backend hands it to the engine
