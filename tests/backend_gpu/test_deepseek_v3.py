"""DeepSeek-V3 (DeepseekV3ForCausalLM) on tiny random checkpoints, one as DeepSeek-V3
is published (q LoRA, YaRN, grouped routing) and one as Kimi-K2 differs from it
(tiny_deepseek.py): greedy output equal to transformers' with chunked prefill and
prefix hits, decodes batched or one by one; the cache holding one latent row per token
and layer; the router picking transformers' experts with its weights; heads split over
two ranks, experts parallel, pipeline stages, n-gram speculation; FP8 weights computing
what their dequantized values say; an FP8 cache and the host tier holding the latent
rows; the multi-token-prediction layers left unread; a config field the engine cannot
honour refused by name, and LoRA."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from backend_gpu import LLM, SamplingParams
from backend_gpu.layers.linear import QuantizedLinear
from backend_gpu.memory import kv_shape_of
from backend_gpu.models.deepseek_v3 import DeepseekV3ForCausalLM, LatentProjection
from tests.backend_gpu.reference import (
    assert_greedy_matches,
    chunked_engines,
    forced_agreement,
    greedy_checker,
    hf_sparse_blocks,
)
from tests.backend_gpu.test_correctness import mixed_prompts
from tests.backend_gpu.test_quantization import weights_of
from tests.backend_gpu.test_tensor_parallel import reference

ARCHS = ["deepseek_v3", "deepseek_v3_kimi"]
MAX_NEW = 12  # as test_tensor_parallel.reference generates
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ROW = 32 + 16  # kv_lora_rank + qk_rope_head_dim: what a token costs a layer's cache
LAYERS = 3


def prompts() -> list[list[int]]:
    """3, 17 and 70 tokens (past YaRN's 64 original positions), and two of 43 and 42
    sharing 40 (two full blocks to hit)."""
    return [mixed_prompts()[i] for i in (0, 1, 4, 5, 6)]


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
    stats = llm.stats()
    assert stats.prefix_hits > 0 and outs[-1].num_cached_tokens >= 32
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prefills_and_decodes_one_by_one_match_transformers(tiny_model_dir, check, arch):
    """One CPU thread: the torch path takes decodes one at a time instead of in padded
    groups; prompts prefilled whole, no prefix cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(
            tiny_model_dir(arch),
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            max_num_batched_tokens=128,
        )
        check(llm, arch)
    finally:
        torch.set_num_threads(threads)
    assert llm.stats().prefix_hits == 0


def test_the_cache_holds_one_latent_row_per_token_and_layer(engines):
    runner = engines("deepseek_v3").engine.runner
    assert runner.kv_shape == (1, ROW) and runner.kv_tensors == 1
    for attn in runner.attention_layers:
        assert attn.k_cache.shape[1:] == (1, ROW) and attn.v_cache.numel() == 0
    stats = engines("deepseek_v3").stats()
    per_token = LAYERS * ROW * 4  # float32
    assert stats.kv_cache_bytes == stats.num_blocks * 16 * per_token
    # what `kvgate plan` and the budget count: one tensor, whatever the heads
    assert kv_shape_of(runner.hf_config, 2, 4).bytes_per_token == per_token
    # full heads would cache 4 heads' keys (16 + 16) and values (24) per layer
    assert per_token / (LAYERS * 4 * (32 + 24) * 4) == pytest.approx(48 / 224)


@pytest.mark.parametrize("arch", ARCHS)
def test_router_picks_transformers_experts(tiny_model_dir, engines, arch):
    prompt = mixed_prompts()[4]
    hf = hf_sparse_blocks(tiny_model_dir(arch), prompt)
    ours = [layer.mlp for layer in engines(arch).engine.runner.model.model.layers]
    ours = [block for block in ours if hasattr(block, "experts")]
    assert len(ours) == len(hf) == (2 if arch == "deepseek_v3" else 3)  # first dense or not
    for block, ref in zip(ours, hf, strict=True):
        assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype
        assert block.gate.e_score_correction_bias.abs().sum() > 0  # the bias is read
        x = ref["x"].reshape(-1, ref["x"].shape[-1])
        _, ref_weights, ref_ids = ref["gate"]
        with torch.inference_mode():
            weights, ids = block.gate(x)
            out = block(x)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
        ours_by_expert = weights.gather(-1, ids.argsort(-1))
        torch.testing.assert_close(ours_by_expert, ref_weights.gather(-1, ref_ids.argsort(-1)))
        assert len(ids.unique()) > 2  # the prompt spreads over experts (and groups)
        torch.testing.assert_close(out, ref["out"].reshape(out.shape), rtol=1e-5, atol=1e-5)


def test_grouped_routing_chooses_within_the_best_groups(engines):
    """4 groups of 2 experts, 2 groups chosen: the experts of every token lie in at most
    two groups, and a correction bias that lifts a group wins it the tokens."""
    gate = engines("deepseek_v3").engine.runner.model.model.layers[1].mlp.gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        _, ids = gate(x)
        assert all(len(set((row // 2).tolist())) <= 2 for row in ids)
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias[6:] += 10.0  # group 3
        try:
            weights, lifted = gate(x)
        finally:
            gate.e_score_correction_bias.copy_(saved)
    assert ((lifted // 2) == 3).any(dim=1).all()
    # the bias picks, the sigmoid scores weigh: renormalized, then times 2.5
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_split_over_two_ranks_match_transformers(tiny_model_dir, check, arch):
    """Two processes over gloo: each rank 2 of the 4 heads (its q and kv_b rows, o
    columns) and a cut of every expert, and the whole latent in its cache."""
    llm = LLM(tiny_model_dir(arch), tensor_parallel_size=2, max_num_batched_tokens=24)
    runner = llm.engine.runner
    attn = runner.attention_layers[0]
    assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * (16 + 24), 32)
    assert attn.k_cache.shape[1:] == (1, ROW)
    check(llm, arch)
    check(llm, arch)  # the prefix hits read the latent rows back
    assert llm.stats().prefix_hits > 0


def test_expert_parallel_over_two_ranks_matches_transformers(tiny_model_dir, check):
    llm = LLM(
        tiny_model_dir("deepseek_v3"),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        max_num_batched_tokens=24,
    )
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and experts.shard.first == 0
    check(llm, "deepseek_v3")


def test_ngram_speculation_and_pipeline_stages_match_transformers(tiny_model_dir, check):
    """Speculative verification runs several queries of a sequence against its latent
    rows at once; two pipeline stages each hold their layers' rows."""
    path = tiny_model_dir("deepseek_v3")
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    llm = LLM(path, max_num_batched_tokens=24, speculative_config=ngram)
    check(llm, "deepseek_v3")
    assert llm.stats().num_drafts > 0
    staged = LLM(path, max_num_batched_tokens=24, pipeline_parallel_size=2)
    check(staged, "deepseek_v3")


def dequantized_experts(model) -> dict[str, torch.Tensor]:
    """Each 8-bit expert stack's weights as it computes with them."""
    out = {}
    for name, module in model.named_modules():
        if getattr(module, "gate_up_scale", None) is not None:
            for proj in ("gate_up", "down"):
                weight, scale = getattr(module, f"{proj}_proj"), getattr(module, f"{proj}_scale")
                out[f"{name}.{proj}_proj"] = weight.float() * scale[..., None]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_weights_compute_what_their_dequantized_values_say(tiny_model_dir, arch):
    """The FP8 engine against the float32 engine holding the dequantized weights: the
    8-bit path adds no error of its own. The absorbed kv_b_proj and the router stay
    as loaded (absorbing reads the one's values, rounding the other picks other
    experts)."""
    path = tiny_model_dir(arch)
    quant = LLM(path, quantization="fp8", max_num_batched_tokens=24)
    model = quant.engine.runner.model
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.o_proj, QuantizedLinear) and isinstance(attn.kv_b_proj, LatentProjection)
    assert attn.kv_b_proj.weight.dtype == moe.gate.weight.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(moe.shared_experts.down_proj, QuantizedLinear)
    ref = LLM(path, max_num_batched_tokens=24)
    params = dict(ref.engine.runner.model.named_parameters())
    modules = dict(ref.engine.runner.model.named_modules())
    for name, weight in weights_of(model).items():
        modules[name].weight.data.copy_(weight)
    for name, weight in dequantized_experts(model).items():
        params[name].data.copy_(weight)
    refs = reference(ref, prompts())
    for out, (ids, logits) in zip(quant.generate(prompts(), GREEDY), refs, strict=True):
        assert_greedy_matches(out.token_ids, ids, logits)


def test_fp8_cache_holds_the_latent_rows(tiny_model_dir, engines):
    """An FP8 cache of latent rows, their scale calibrated over the whole row: the
    next token after each prefix of the float32 engine's output mostly agrees (these
    random routers amplify rounding, as Mixtral's do in test_moe.py)."""
    refs = engines("deepseek_v3").generate(prompts(), GREEDY)
    llm = LLM(tiny_model_dir("deepseek_v3"), kv_cache_dtype="fp8", max_num_batched_tokens=24)
    attn = llm.engine.runner.attention_layers[0]
    assert attn.k_cache.dtype == torch.float8_e4m3fn and attn.k_cache.shape[1:] == (1, ROW)
    assert attn.k_scale != 1.0
    assert llm.stats().kv_cache_bytes == llm.stats().num_blocks * 16 * LAYERS * ROW
    assert forced_agreement(llm, prompts(), refs) >= 0.6


def test_latent_blocks_go_down_to_the_host_tier_and_come_back(tiny_model_dir, engines):
    """A device pool of 12 blocks of 8 under a host tier (the 70-token prompt and its
    output take 11): the prompts' blocks are evicted to host rows of the latent's bytes
    (one tensor a layer) and loaded back as hits."""
    block_bytes = 8 * LAYERS * ROW * 4
    llm = LLM(
        tiny_model_dir("deepseek_v3"),
        block_size=8,
        max_model_len=88,
        kv_cache_memory_bytes=12 * block_bytes,
        kv_offload_gb=64 * block_bytes / (1 << 30),
    )
    plain = engines("deepseek_v3")
    long_prompts = [p for p in prompts() if len(p) > 40]
    want = [o.token_ids for o in plain.generate(long_prompts, GREEDY)]
    for _ in range(2):
        for prompt, ids in zip(long_prompts, want, strict=True):
            assert llm.generate([prompt], GREEDY)[0].token_ids == ids
    stats = llm.stats()
    assert stats.kv_host_blocks_written > 0 and stats.kv_host_blocks_loaded > 0
    assert stats.kv_host_bytes == stats.kv_host_blocks * block_bytes


def test_multi_token_prediction_layers_are_not_read(tiny_model_dir, tmp_path, engines):
    """DeepSeek-V3's checkpoint carries layer 61 (num_nextn_predict_layers) after its
    61 layers: tensors of a layer past the last are skipped, not an error."""
    path = tmp_path / "with-mtp"
    shutil.copytree(tiny_model_dir("deepseek_v3"), path)
    extra = {
        f"model.layers.{LAYERS}.eh_proj.weight": torch.randn(64, 128),
        f"model.layers.{LAYERS}.self_attn.kv_b_proj.weight": torch.randn(160, 32),
    }
    save_file(extra, str(path / "mtp.safetensors"))
    want = [o.token_ids for o in engines("deepseek_v3").generate(prompts()[:2], GREEDY)]
    got = [o.token_ids for o in LLM(str(path)).generate(prompts()[:2], GREEDY)]
    assert got == want


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scoring_func", "softmax"),
        ("topk_method", "group_limited_greedy"),
        ("moe_layer_freq", 2),
        ("hidden_act", "gelu"),
        ("n_group", 3),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
        ("rope_parameters.long_factor", {"rope_type": "yarn", "long_factor": [1.0]}),
        ("index_topk", 2048),  # DeepSeek-V3.2's sparse attention: another model
    ],
)
def test_a_field_the_engine_cannot_honour_is_refused_by_name(tiny_model_dir, field, value):
    config = AutoConfig.from_pretrained(tiny_model_dir("deepseek_v3"))
    if field.startswith("rope"):
        config.rope_parameters = dict(config.rope_parameters, **value)
    else:
        setattr(config, field, value)
    with pytest.raises(NotImplementedError, match=field), torch.device("meta"):
        DeepseekV3ForCausalLM(config)


def test_a_checkpoint_with_an_unknown_router_is_refused_at_load(tiny_model_dir, tmp_path):
    path = tmp_path / "softmax-router"
    shutil.copytree(tiny_model_dir("deepseek_v3"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, scoring_func="softmax")))
    with pytest.raises(NotImplementedError, match="scoring_func='softmax' is not supported"):
        LLM(str(path))


def test_lora_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="LoRA adapters on DeepseekV3ForCausalLM"):
        LLM(tiny_model_dir("deepseek_v3"), enable_lora=True)
