"""Phi-3 / Phi-4 on tiny random checkpoints: greedy output equal to transformers' with a
sliding window on every layer (Phi-3-mini-4k's shape) under chunked prefill, prefix
caching and whole prefills; with partial rotary and LongRoPE (Phi-4-mini's shape), the
long factors for an engine whose context exceeds the original and the short ones for one
that does not, cos and sin equal to transformers' tables; the fused qkv_proj and
gate_up_proj tensors read as their parts, whole or a rank's; two ranks; two pipeline
stages; FP8 weights; a
rope type Phi-3 does not have refused naming the field."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from transformers import AutoConfig
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as HFRotary

from backend_gpu import LLM, SamplingParams
from backend_gpu.distributed import ParallelGroup
from backend_gpu.loader import Checkpoint
from backend_gpu.models.phi3 import Phi3ForCausalLM, Phi3RotaryEmbedding
from backend_gpu.pp_stages import MissingLayer
from backend_gpu.tp_shards import CheckpointShards
from tests.backend_gpu.reference import assert_greedy_matches, forced_agreement, hf_greedy
from tests.backend_gpu.test_correctness import SETTINGS, check, mixed_prompts
from tests.backend_gpu.tiny_models import VOCAB

MAX_NEW = 12


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_windowed_phi3_matches_transformers(tiny_model_dir, setting):
    model_dir = tiny_model_dir("phi3_window")
    llm = LLM(model_dir, **SETTINGS[setting])
    model = llm.engine.runner.model
    assert isinstance(model, Phi3ForCausalLM)
    assert [layer.self_attn.window for layer in model.model.layers] == [16, 16]
    assert max(len(p) for p in mixed_prompts()) > 4 * 16  # prompts run past the window
    check(llm, model_dir)
    outs = check(llm, model_dir)  # again: the prompts' full blocks are cached
    if llm.engine.config.enable_prefix_caching:
        assert outs[-1].num_cached_tokens >= 32


def long_prompts() -> list[list[int]]:
    """Longer than the 32 original positions, where transformers rotates by the long
    factors throughout (two share 40 tokens: a prefix to cache)."""
    return [p for p in mixed_prompts() if len(p) > 32]


def short_prompts() -> list[list[int]]:
    """With 12 new tokens within the 32 original positions, where transformers rotates by
    the short factors throughout (two share a block of 16)."""
    rng = random.Random(7)
    shared = [rng.randrange(4, VOCAB) for _ in range(16)]
    return [[5, 9, 30], shared + [8, 9, 10, 11], shared + [12, 13]]


def greedy_matches(llm: LLM, model_dir: str, prompts: list[list[int]]) -> list:
    refs = hf_greedy(model_dir, prompts, MAX_NEW)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for _ in range(2):  # the second time from the prefix cache
        outs = llm.generate(prompts, params)
        for out, (ref_ids, ref_logits) in zip(outs, refs, strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    return outs


def test_longrope_long_factors_match_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("phi3")
    llm = LLM(model_dir, max_num_batched_tokens=24)  # 256 positions: past the original 32
    rotary = llm.engine.runner.model.rotary
    assert rotary.long and rotary.rotary_dim == 12
    # factor 256 / 32: transformers' sqrt(1 + ln(factor) / ln(original))
    assert rotary.magnitude == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    outs = greedy_matches(llm, model_dir, long_prompts())
    assert outs[-1].num_cached_tokens >= 32


def test_longrope_short_factors_within_the_original_context(tiny_model_dir):
    model_dir = tiny_model_dir("phi3")
    llm = LLM(model_dir, max_model_len=32, max_num_batched_tokens=8)
    rotary = llm.engine.runner.model.rotary
    assert not rotary.long
    outs = greedy_matches(llm, model_dir, short_prompts())
    assert outs[-1].num_cached_tokens == 16
    # the same model served past the original context: its keys are rotated otherwise
    long = LLM(model_dir, max_num_batched_tokens=24).engine.runner.model.rotary
    assert not torch.equal(long.cos[:32], rotary.cos[:32])


@pytest.mark.parametrize("long", [False, True])
def test_rotary_tables_are_transformers_and_pass_the_rest_through(tiny_model_dir, long):
    config = AutoConfig.from_pretrained(tiny_model_dir("phi3"))
    ours = Phi3RotaryEmbedding(config)
    ours.set_context_len(256 if long else 32)
    ours.compute_tables()
    positions = torch.arange(40 if long else 20)  # transformers picks by the longest
    x = torch.zeros(1, 1, 16)
    hf_cos, hf_sin = HFRotary(config)(x, positions[None])
    assert torch.equal(ours.cos[positions], hf_cos[0])
    assert torch.equal(ours.sin[positions], hf_sin[0])
    q, k = torch.randn(len(positions), 4, 16), torch.randn(len(positions), 2, 16)
    q_rot, k_rot = ours(positions, q, k)
    assert torch.equal(q_rot[..., 12:], q[..., 12:]) and torch.equal(k_rot[..., 12:], k[..., 12:])
    assert not torch.allclose(q_rot[1:, :, :12], q[1:, :, :12])


def test_fused_tensors_are_read_as_their_parts(tiny_model_dir):
    path = tiny_model_dir("phi3")
    config = AutoConfig.from_pretrained(path)
    whole = dict(Checkpoint(path).tensors())
    assert whole["model.layers.0.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    fused = Phi3ForCausalLM.fused_checkpoint_tensors(config)
    parts = dict(Checkpoint(path).tensors(fused=fused))
    qkv = whole["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], qkv[64:96])
    gate_up = whole["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(parts["model.layers.1.mlp.up_proj.weight"], gate_up[128:])
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in parts)
    # rank 1 of 2: its 2 query heads and 1 KV head of each part, its half of gate and up
    shards = CheckpointShards(config, 16, ParallelGroup(1, 2))
    rank1 = dict(Checkpoint(path).tensors(shards, fused=fused))
    assert torch.equal(rank1["model.layers.0.self_attn.q_proj.weight"], qkv[32:64])
    assert torch.equal(rank1["model.layers.0.self_attn.v_proj.weight"], qkv[112:128])
    assert torch.equal(rank1["model.layers.1.mlp.gate_proj.weight"], gate_up[64:128])


def test_two_ranks_match_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("phi3")
    llm = LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=24)
    attn = llm.engine.runner.attention_layers[0]
    assert attn.num_heads == 2 and attn.qkv_proj.weight.shape == (32 + 2 * 16, 64)
    greedy_matches(llm, model_dir, long_prompts())


def test_two_pipeline_stages_match_transformers(tiny_model_dir):
    """Each stage reads its own layer's fused tensors; the tied head's stage keeps the
    embedding's table."""
    model_dir = tiny_model_dir("phi3")
    llm = LLM(model_dir, pipeline_parallel_size=2, max_num_batched_tokens=24)
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0], MissingLayer)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    greedy_matches(llm, model_dir, long_prompts())
    llm.engine.close()


def test_fp8_weights_agree_with_the_unquantized_model(tiny_model_dir):
    path = tiny_model_dir("phi3")
    prompts = long_prompts()
    refs = LLM(path).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    llm = LLM(path, quantization="fp8", max_num_batched_tokens=24)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert forced_agreement(llm, prompts, refs) >= 0.75


def test_a_rope_type_phi3_lacks_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    path = tmp_path / "phi3"
    shutil.copytree(tiny_model_dir("phi3"), path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="rope_parameters.*type field"):
        LLM(str(path))
