"""`kvgate plan` of gpt-oss: gpt-oss-120b by hand (its MXFP4 experts' bytes against
bfloat16, its sliding layers' KV bounded per sequence, the tensor-parallel sizes its MXFP4
experts can be cut over), the command's lines about them, and the plan against what the
engine holds for the tiny MXFP4 checkpoint."""

from __future__ import annotations

import json

import pytest

from backend_gpu import LLM
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory
from gateway.cli.main import main as kvgate
from tests.backend_gpu.mxfp4_checkpoints import PUBLISHED_QUANTIZATION, write_mxfp4_checkpoint

GIB = 1 << 30
MIB = 1 << 20
H100 = PlanDevice("h100-80gb", 81_559 * MIB, 512 * MIB)

# openai/gpt-oss-120b's config.json as published on the Hugging Face hub (August 2025),
# written here from its numbers, which the model card's table repeats (36 layers, 128
# experts with 4 active, 117B parameters of which 5.1B active, a 128-token window on
# every other layer, 131,072 positions by YaRN over 4,096); its fields as it spells
# them, OpenAI's own names (experts_per_token, initial_context_length) and the older
# transformers' rope_scaling and rope_theta included
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": PUBLISHED_QUANTIZATION,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}
H, LAYERS, VOCAB, EXPERTS, INTER = 2880, 36, 201088, 128, 2880
Q, KV = 64 * 64, 8 * 64
# per layer: q/k/v and o with biases, a sink per head, the router with its bias, two norms
ATTENTION = (Q + 2 * KV) * (H + 1) + H * Q + H + 64
OTHERS = EXPERTS * (H + 1) + 2 * H
EXPERT_ROWS = 2 * INTER + H  # gate/up's rows and down's, each over H (= INTER) inputs
EXPERT_WEIGHTS = EXPERTS * EXPERT_ROWS * H
EXPERT_BIASES = EXPERTS * EXPERT_ROWS


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT_OSS_120B))
    return str(path)


def test_gpt_oss_120b_by_hand(config_path):
    plan = plan_memory(config_path, H100, PlanSettings())
    tables = 2 * VOCAB * H  # untied embedding and head
    per_layer = ATTENTION + OTHERS + EXPERT_WEIGHTS + EXPERT_BIASES
    assert plan.parameters == LAYERS * per_layer + tables + H == 116_829_156_672  # "117B"
    assert plan.weight_bytes["bfloat16"] == 2 * plan.parameters
    # MXFP4: 4 bits a weight and a byte of scale per 32 (17/32 of a byte); biases bf16
    packed = EXPERT_WEIGHTS * 17 // 32 + 2 * EXPERT_BIASES
    assert plan.expert_bytes == {
        "mxfp4": LAYERS * packed,
        "bfloat16": LAYERS * 2 * (EXPERT_WEIGHTS + EXPERT_BIASES),
    }
    assert plan.expert_bytes["mxfp4"] / plan.expert_bytes["bfloat16"] < 0.27
    rest = 2 * (LAYERS * (ATTENTION + OTHERS) + tables + H)
    assert plan.weight_bytes["mxfp4"] == LAYERS * packed + rest == 65_248_815_744  # 60.8 GiB
    # GQA: 8 KV heads of 64 in 36 layers, a key and a value, bfloat16
    per_token = 2 * LAYERS * KV * 2
    assert per_token == 73728  # 72 KiB
    assert plan.kv_bytes_per_token == {"auto": per_token, "fp8": per_token // 2}
    # half the layers slide over 128 tokens: a window-aware cache's 131072-token sequence
    assert (plan.sliding_window, plan.sliding_layers, plan.max_model_len) == (128, 18, 131072)
    layer_token = per_token // LAYERS
    assert plan.kv_bytes_per_seq_windowed == (18 * 131072 + 18 * 128) * layer_token
    # TP 4 and 8 would cut down's 2880 inputs mid-group (720 and 360 a rank): not listed
    assert [r.tp_size for r in plan.ranks] == [1, 2]
    tp1 = plan.ranks[0]
    assert tp1.weight_bytes == plan.weight_bytes["mxfp4"]  # the engine keeps them packed
    budget = int(81_559 * MIB * 0.9) - 512 * MIB - tp1.weight_bytes
    assert tp1.kv.budget == budget - tp1.activation_bytes - tp1.graph_pool_bytes
    # one H100: room for one full-length sequence (9 GiB of KV), as the model card says
    assert plan.chosen is tp1 and tp1.max_concurrent_seqs == 1


def test_the_command_says_so(config_path, capsys):
    assert kvgate(["plan", config_path, "--gpu-memory", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "GptOssForCausalLM, 116.829B parameters" in out
    assert "mxfp4 60.77 GiB" in out
    assert "experts    MXFP4 as the checkpoint ships them, kept so: 56.80 GiB (0.27x" in out
    # what the engine holds, and what a window-aware cache would: 9 GiB against 4.5
    assert (
        "18 of 36 layers slide over 128 tokens, but kvgate caches them in full, as the "
        "blocks below count: a 131072-token sequence takes 9.00 GiB (a window-aware "
        "cache: 4.50 GiB)"
    ) in out
    assert "weights bfloat16, experts mxfp4" in out


def test_plan_matches_the_engine(tiny_model_dir, tmp_path):
    """The tiny MXFP4 checkpoint on the CPU: the weight bytes and KV blocks the engine
    holds are the plan's."""
    model = write_mxfp4_checkpoint(tiny_model_dir("gpt_oss"), str(tmp_path / "mxfp4"))
    budget = 3 * MIB
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=budget, max_model_len=256)
    settings = PlanSettings(
        dtype="float32", kv_cache_memory_bytes=budget, max_model_len=256, tensor_parallel_size=1
    )
    plan = plan_memory(model, PlanDevice("cpu", 0, 0), settings)
    runner = llm.engine.runner
    assert plan.ranks[0].weight_bytes == runner.weight_bytes == plan.weight_bytes["mxfp4"]
    assert plan.ranks[0].kv.cache_bytes == runner.kv_cache_bytes
    assert plan.expert_bytes["mxfp4"] < 0.2 * plan.expert_bytes["float32"]  # 17/128 + biases
