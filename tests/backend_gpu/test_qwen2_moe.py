"""Qwen2-MoE on tiny random checkpoints: greedy output equal to transformers' with chunked
prefill and prefix hits, top-k weights renormalized or not, dense layers by
mlp_only_layers or decoder_sparse_step; each sparse block (router, routed experts, the
shared expert and its sigmoid gate) computes transformers' block output; two ranks, the
experts cut or whole (expert parallel), and two pipeline stages decode what transformers
does; FP8 experts and
shared expert with the router and the gate left unquantized; the shared expert's
checkpoint reads cut by its own size; kvgate plan counts the shared experts."""

from __future__ import annotations

import json
import shutil

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
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory
from backend_gpu.models.llama import GatedMLP
from backend_gpu.models.qwen2_moe import SharedExpertMoeBlock
from backend_gpu.pp_stages import MissingLayer
from backend_gpu.tp_shards import SKIP, ShardRead
from tests.backend_gpu.reference import (
    chunked_engines,
    forced_agreement,
    greedy_checker,
    hf_sparse_blocks,
)
from tests.backend_gpu.test_correctness import mixed_prompts
from tests.backend_gpu.test_moe import prompts

ARCHS = ["qwen2_moe", "qwen2_moe_norm"]
SPARSE = {"qwen2_moe": [0, 2], "qwen2_moe_norm": [1]}  # the other layers dense
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
GIB = 1 << 30


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
    layers = llm.engine.runner.model.model.layers
    blocks = [type(layer.mlp) for layer in layers]
    assert [i for i, b in enumerate(blocks) if b is SharedExpertMoeBlock] == SPARSE[arch]
    assert all(b in (SharedExpertMoeBlock, GatedMLP) for b in blocks)
    assert layers[0].self_attn.qkv_proj.bias is not None  # qkv_bias
    assert layers[0].self_attn.o_proj.bias is None
    renormalized = [layers[i].mlp.gate.renormalize for i in SPARSE[arch]]
    assert renormalized == [arch == "qwen2_moe_norm"] * len(SPARSE[arch])
    check(llm, arch)
    outs = check(llm, arch)  # again: the prompts' full blocks are cached
    assert llm.stats().prefix_hits > 0 and outs[-1].num_cached_tokens >= 32


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_blocks_compute_transformers_block(tiny_model_dir, engines, arch):
    """Per sparse layer, on transformers' own block input: the router's experts and
    weights, and the block's output, shared expert and its gate included."""
    prompt = mixed_prompts()[4]
    hf = hf_sparse_blocks(tiny_model_dir(arch), prompt)
    layers = engines(arch).engine.runner.model.model.layers
    ours = [layers[i].mlp for i in SPARSE[arch]]
    assert len(ours) == len(hf)
    for block, ref in zip(ours, hf, strict=True):
        x = ref["x"].reshape(-1, ref["x"].shape[-1])
        _, ref_weights, ref_ids = ref["gate"]
        with torch.inference_mode():
            weights, ids = block.gate(x)
            out = block(x)
            shared = block.shared_expert_gate(x) * block.shared_expert(x)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
        ours_by_expert = weights.gather(-1, ids.argsort(-1))
        torch.testing.assert_close(ours_by_expert, ref_weights.gather(-1, ref_ids.argsort(-1)))
        assert shared.abs().max() > 0.01  # the shared expert counts in the output
        torch.testing.assert_close(out, ref["out"].reshape(out.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["cut", "expert-parallel"])
def test_two_ranks_match_transformers(tiny_model_dir, check, expert_parallel):
    """Two processes over gloo: every expert and the shared expert cut in half, or each
    rank holding 4 of the 8 experts whole (and half the shared expert either way)."""
    llm = LLM(
        tiny_model_dir("qwen2_moe"),
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=24,
    )
    block = llm.engine.runner.model.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape[:2] == ((4, 64) if expert_parallel else (8, 32))
    assert block.shared_expert.down_proj.weight.shape == (64, 24)
    check(llm, "qwen2_moe")


def test_two_pipeline_stages_match_transformers(tiny_model_dir, check):
    """Three layers over two stages: stage 0 (another process) the sparse layer 0 and
    the dense layer 1, the engine's stage the sparse layer 2 with its shared expert."""
    llm = LLM(tiny_model_dir("qwen2_moe"), pipeline_parallel_size=2, max_num_batched_tokens=24)
    layers = llm.engine.runner.model.model.layers
    assert all(isinstance(layer, MissingLayer) for layer in layers[:2])
    assert isinstance(layers[2].mlp, SharedExpertMoeBlock)
    check(llm, "qwen2_moe")
    llm.engine.close()


def test_fp8_engine_agrees_with_the_unquantized_model(tiny_model_dir, engines):
    prompt_ids = mixed_prompts()[:4]
    refs = engines("qwen2_moe").generate(prompt_ids, SamplingParams(temperature=0, max_tokens=8))
    llm = LLM(tiny_model_dir("qwen2_moe"), quantization="fp8", max_num_batched_tokens=24)
    block = llm.engine.runner.model.model.layers[0].mlp
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert block.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert block.gate.weight.dtype == block.shared_expert_gate.weight.dtype == torch.float32
    # as Mixtral's (test_moe): routing amplifies rounding, so teacher-forced agreement
    assert forced_agreement(llm, prompt_ids, refs) >= 0.6


MOE = MoEConfig(8, 2, 32, False, ("gate_proj", "up_proj", "down_proj"), frozenset({0}), 48)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_shared_expert_is_read_cut_by_its_own_size(expert_parallel):
    shard = ExpertShard.of(MOE, ParallelGroup(1, 2), expert_parallel)
    dense = lambda name: ShardRead(0, 64, 128)  # noqa: E731 (the dense MLP's cut, 128 / 2)
    reads = ExpertCheckpointShards(MOE, shard, dense)
    name = "model.layers.0.mlp.shared_expert.{}.weight"
    assert reads(name.format("gate_proj")) == ShardRead(0, 24, 48)
    assert reads(name.format("up_proj")) == ShardRead(0, 24, 48)
    assert reads(name.format("down_proj")) == ShardRead(1, 24, 48)
    assert reads("model.layers.0.mlp.shared_expert_gate.weight") == ShardRead(0, 64, 128)
    assert reads("model.layers.1.mlp.gate_proj.weight") == ShardRead(0, 64, 128)  # dense
    expert = reads("model.layers.0.mlp.experts.1.gate_proj.weight")
    assert expert == (SKIP if expert_parallel else ShardRead(0, 16, 32))


def test_a_shared_expert_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="shared expert's intermediate size 48"):
        check_experts_divisible(MOE, 32, expert_parallel=False)  # 32 divides the experts'
    check_experts_divisible(MOE, 16, expert_parallel=False)


# Qwen/Qwen1.5-MoE-A2.7B's config.json (the fields the engine reads); 14.3B parameters
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 8192,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


def test_plan_counts_the_shared_experts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN15_MOE))
    device = PlanDevice("h100-80gb", 80 * GIB, 0)
    plan = plan_memory(str(path), device, PlanSettings(kv_cache_memory_bytes=GIB))
    h, layers, vocab = 2048, 24, 151936
    attention = 4 * h * h + 3 * h  # q, k, v, o; the q/k/v biases
    routed = 60 * 3 * h * 1408 + 60 * h  # the experts, the router
    shared = 3 * h * 5632 + h  # the shared expert and its gate
    per_layer = attention + routed + shared + 2 * h  # two norms
    assert plan.parameters == layers * per_layer + 2 * vocab * h + h == 14_315_784_192
    assert plan.weight_bytes["bfloat16"] == 2 * plan.parameters
    # 8-bit: every expert's and the shared expert's rows a byte each with a float32 scale
    # per row; the routers, the shared experts' gates and biases stay 16-bit
    linears = [(3 * h, h), (h, h), (2 * 5632, h), (h, 5632)]
    experts = [(60 * 2 * 1408, h), (60 * h, 1408)]
    eight_bit = sum(r * c + 4 * r - 2 * r * c for r, c in linears + experts) * layers
    table = vocab * h + vocab * h // 32 * 4 - 2 * vocab * h
    assert plan.weight_bytes["fp8"] == plan.weight_bytes["bfloat16"] + eight_bit + 2 * table


def test_an_unknown_rope_type_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    path = tmp_path / "qwen2_moe"
    shutil.copytree(tiny_model_dir("qwen2_moe"), path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="rope_scaling .*type 'dynamic'"):
        LLM(str(path))
