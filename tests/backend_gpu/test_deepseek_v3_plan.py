"""`kvgate plan` of DeepSeek-V3: the 671B model by hand (its parameters, its weights in
bfloat16 and FP8 with the router kept float32 and the absorbed kv_b_proj kept 16-bit, its
latent KV row against every head's keys and values, the tensor-parallel size that fits
eight H200s), the command's lines about it and about its published block-wise FP8, and
the plan against what the engine holds for the tiny checkpoint."""

from __future__ import annotations

import json

import pytest

from backend_gpu import LLM
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory
from gateway.cli.main import main as kvgate

MIB = 1 << 20
H200 = PlanDevice("h200", 143_771 * MIB, 512 * MIB)

# deepseek-ai/DeepSeek-V3's config.json as published on the Hugging Face hub (December
# 2024), its fields as it spells them (the older transformers' rope_scaling, DeepSeek's
# own scoring_func, topk_method, moe_layer_freq, ep_size); without its quantization_config
# (PUBLISHED_FP8): this is the bfloat16 conversion its fp8_cast_bf16.py writes
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# its block-wise FP8 as published (quantization/block_fp8.py)
PUBLISHED_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
H, VOCAB, LAYERS, DENSE = 7168, 129280, 61, 3
SPARSE = LAYERS - DENSE
HEADS, NOPE, ROPE, V, Q_RANK, KV_RANK = 128, 128, 64, 128, 1536, 512
EXPERTS, EXPERT_INTER, INTER = 256, 2048, 18432
# the linear layers of a layer's attention, as (rows, columns): q_a, q_b, kv_a, o
ATTENTION = [(Q_RANK, H), (HEADS * (NOPE + ROPE), Q_RANK), (KV_RANK + ROPE, H), (H, HEADS * V)]
KV_B = HEADS * (NOPE + V) * KV_RANK  # absorbed, never quantized
LATENT_NORMS = Q_RANK + KV_RANK
DENSE_MLP = [(2 * INTER, H), (H, INTER)]  # gate/up packed, down
SHARED = [(2 * EXPERT_INTER, H), (H, EXPERT_INTER)]  # one shared expert
EXPERT_ROWS = EXPERTS * (2 * EXPERT_INTER + H)  # gate/up's rows and down's, all experts
EXPERT_WEIGHTS = EXPERTS * 3 * EXPERT_INTER * H
ROUTER = EXPERTS * H + EXPERTS  # its weight and correction bias, float32


def weights(matrices) -> int:
    return sum(rows * cols for rows, cols in matrices)


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    return str(path)


def test_deepseek_v3_671b_by_hand(config_path):
    plan = plan_memory(config_path, H200, PlanSettings(quantization="fp8"))
    attention = weights(ATTENTION) + KV_B + LATENT_NORMS + 2 * H  # and the two layer norms
    moe = EXPERT_WEIGHTS + weights(SHARED) + ROUTER
    tables = 2 * VOCAB * H  # untied embedding and head
    params = LAYERS * attention + DENSE * weights(DENSE_MLP) + SPARSE * moe + tables + H
    assert plan.parameters == params == 671_026_419_200  # "671B", without the MTP layer
    # bfloat16, but the routers float32 as transformers keeps them
    assert plan.weight_bytes["bfloat16"] == 2 * params + 2 * SPARSE * ROUTER
    # FP8: each linear layer and expert a byte a weight and a float32 scale a row; the
    # token tables INT8 with a float32 scale per 32; kv_b_proj, norms, routers as they are
    linears = LAYERS * weights(ATTENTION) + DENSE * weights(DENSE_MLP) + SPARSE * weights(SHARED)
    rows = LAYERS * sum(r for r, _ in ATTENTION)
    rows += DENSE * sum(r for r, _ in DENSE_MLP) + SPARSE * sum(r for r, _ in SHARED)
    eight_bit = linears + SPARSE * EXPERT_WEIGHTS + 4 * (rows + SPARSE * EXPERT_ROWS)
    sixteen_bit = 2 * (LAYERS * (KV_B + LATENT_NORMS + 2 * H) + H)
    assert plan.weight_bytes["fp8"] == (
        eight_bit + sixteen_bit + 4 * SPARSE * ROUTER + tables + tables // 32 * 4
    )
    # MLA: one row of 512 + 64 a token and layer; every head's keys (192) and values (128)
    assert plan.kv_bytes_per_token == {"auto": LAYERS * 576 * 2, "fp8": LAYERS * 576}
    assert plan.kv_bytes_per_token["auto"] == 70_272  # 68.6 KiB
    full = LAYERS * HEADS * (NOPE + ROPE + V) * 2
    assert plan.full_heads_kv_bytes_per_token == full == 4_997_120  # 4.8 MiB, 71x
    # every size divides the heads and both intermediate sizes; FP8 weights are 625 GiB,
    # so eight H200s it is, and the latent row is whole on every rank: a rank's block
    # costs what one device's does (GQA's would be cut 8 ways)
    assert [r.tp_size for r in plan.ranks] == [1, 2, 4, 8]
    tp8 = plan.chosen
    assert tp8 is plan.ranks[-1] and tp8.kv.bytes_per_block == 16 * 70_272
    budget = int(143_771 * MIB * 0.9) - 512 * MIB - tp8.weight_bytes
    assert tp8.kv.budget == budget - tp8.activation_bytes - tp8.graph_pool_bytes
    assert tp8.max_concurrent_seqs == tp8.kv.num_blocks // (163_840 // 16) >= 2
    # with every head cached the same budget would not hold one sequence of 163840
    assert tp8.kv.budget < 163_840 * full // 8


def test_the_command_says_so(config_path, capsys):
    argv = ["plan", config_path, "--gpu-memory", "h200", "--quantization", "fp8"]
    assert kvgate(argv) == 0
    out = capsys.readouterr().out
    assert "DeepseekV3ForCausalLM, 671.026B parameters" in out
    assert "KV/token   auto 68.6 KiB, fp8 34.3 KiB (61 layers" in out
    assert "4880.0 KiB for every head's key and value (71.1x)" in out
    assert "smallest tensor-parallel size that fits: 8" in out


def test_plan_matches_the_engine(tiny_model_dir):
    """The tiny checkpoint on the CPU: the weight bytes (the float32 router among them)
    and KV blocks the engine holds are the plan's, and the plan's activation estimate
    counts MLA's latent-wide queries."""
    model = tiny_model_dir("deepseek_v3")
    budget = 3 * MIB
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=budget, max_model_len=256)
    settings = PlanSettings(
        dtype="float32", kv_cache_memory_bytes=budget, max_model_len=256, tensor_parallel_size=1
    )
    plan = plan_memory(model, PlanDevice("cpu", 0, 0), settings)
    runner = llm.engine.runner
    assert plan.ranks[0].weight_bytes == runner.weight_bytes == plan.weight_bytes["float32"]
    assert plan.ranks[0].kv.cache_bytes == runner.kv_cache_bytes
    assert plan.kv_bytes_per_token["auto"] == 3 * (32 + 16) * 4
    assert plan.full_heads_kv_bytes_per_token == 3 * 4 * (16 + 16 + 24) * 4


def test_the_published_block_fp8_checkpoint_is_counted(tmp_path, capsys):
    """DeepSeek-V3's config.json as published, with its quantization_config: the plan
    names the tiles and what the engine holds of them, widened (bfloat16 fits no size
    of H200s) or with --quantization fp8 (eight)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DEEPSEEK_V3, "quantization_config": PUBLISHED_FP8}))
    plan = plan_memory(str(path), H200, PlanSettings())
    assert plan.fp8_tiles == (128, 128) and plan.chosen is None
    assert kvgate(["plan", str(path), "--gpu-memory", "h200"]) == 1
    out = capsys.readouterr().out
    bf16, fp8 = plan.weight_bytes["bfloat16"] / (1 << 30), plan.weight_bytes["fp8"] / (1 << 30)
    assert (
        f"checkpoint FP8 in 128x128 tiles (block-wise fp8), widened to bfloat16 as it loads "
        f"({bf16:.2f} GiB); --quantization fp8 holds it in FP8 ({fp8:.2f} GiB)" in out
    )
    assert kvgate(["plan", str(path), "--gpu-memory", "h200", "--quantization", "fp8"]) == 0
    assert "smallest tensor-parallel size that fits: 8" in capsys.readouterr().out
    bad = {**PUBLISHED_FP8, "fmt": "e5m2"}
    path.write_text(json.dumps({**DEEPSEEK_V3, "quantization_config": bad}))
    assert kvgate(["plan", str(path), "--gpu-memory", "h200"]) == 2
    assert "quantization_config.fmt 'e5m2' is not supported" in capsys.readouterr().err
