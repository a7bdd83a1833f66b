"""gpt-oss on a tiny random checkpoint (tiny_gpt_oss.py: sinks, a 16-token window on one
layer of two, YaRN, biased router and experts, the swiglu clamps binding), in its 16-bit
layout and in MXFP4 as published (mxfp4_checkpoints.py): greedy output equal to
transformers' (which loads the MXFP4 one dequantized, by its own Mxfp4Config) under
chunked prefill, prefix caching and the other batching settings, over two ranks cut by
tensor parallel and by expert parallel; each layer's router and experts equal to
transformers' block; two pipeline stages; FP8 experts; what the engine cannot honour of a config refused by
name; and on CUDA (skipped without one), the MXFP4 experts through their Triton kernel."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Mxfp4Config

from backend_gpu import LLM, SamplingParams
from backend_gpu.layers import attention, cpu_kernels
from backend_gpu.layers.gpt_oss_moe import BiasedExperts, Mxfp4Experts
from backend_gpu.pp_stages import MissingLayer
from tests.backend_gpu.mxfp4_checkpoints import write_mxfp4_checkpoint
from tests.backend_gpu.reference import (
    assert_greedy_matches,
    forced_agreement,
    hf_greedy,
    hf_sparse_blocks,
)
from tests.backend_gpu.test_correctness import SETTINGS, mixed_prompts

FORMATS = ["16-bit", "mxfp4"]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """model_dir(fmt): the tiny gpt-oss checkpoint in that format."""
    made: dict[str, str] = {}

    def get(fmt: str) -> str:
        if fmt not in made:
            path = tiny_model_dir("gpt_oss")
            if fmt == "mxfp4":
                path = write_mxfp4_checkpoint(path, str(tmp_path_factory.mktemp("mxfp4")))
            made[fmt] = path
        return made[fmt]

    return get


def hf_kwargs(fmt: str) -> dict:
    """How transformers loads the format: MXFP4 dequantized by its own code."""
    return {"quantization_config": Mxfp4Config(dequantize=True)} if fmt == "mxfp4" else {}


@pytest.fixture(scope="module")
def check(model_dir):
    """check(llm, fmt, prompts): greedy outputs equal transformers' (computed once)."""
    refs: dict[tuple, list] = {}

    def run(llm: LLM, fmt: str, prompts: list[list[int]]) -> list:
        key = (fmt, tuple(map(tuple, prompts)))
        if key not in refs:
            refs[key] = hf_greedy(model_dir(fmt), prompts, MAX_NEW, **hf_kwargs(fmt))
        outs = llm.generate(prompts, GREEDY)
        for out, (ref_ids, ref_logits) in zip(outs, refs[key], strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
        return outs

    return run


def few_prompts() -> list[list[int]]:
    """17 tokens, and two of 43 and 42 sharing 40 (two full blocks to hit)."""
    return [mixed_prompts()[i] for i in (1, 5, 6)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(model_dir, check, fmt, setting):
    llm = LLM(model_dir(fmt), **SETTINGS[setting])
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.window for layer in layers] == [16, None]
    assert max(len(p) for p in mixed_prompts()) > 4 * 16  # past the window
    experts = layers[0].mlp.experts
    # packed for oneDNN (cpu_packed.py): the attention's projections, the untied head
    assert layers[0].self_attn.qkv_proj.weight.is_mkldnn
    assert llm.engine.runner.model.lm_head.weight.is_mkldnn
    if fmt == "mxfp4":  # kept packed: 4 bits a value and a byte per 32
        assert isinstance(experts, Mxfp4Experts)
        assert experts.gate_up_proj_blocks.dtype == torch.uint8
        assert experts.gate_up_proj_blocks.shape == (8, 128, 2, 16)
    elif cpu_kernels.library() is not None:  # float32: the engine's kernel reads them stacked
        assert isinstance(experts, BiasedExperts) and experts.kernel
        assert experts.packed is None and experts.gate_up_proj is not None
    else:  # float32 on the CPU: packed for oneDNN, the stacked copies dropped
        assert isinstance(experts, BiasedExperts) and experts.gate_up_proj is None
        assert len(experts.packed["gate_up"]) == 8
    check(llm, fmt, mixed_prompts())
    outs = check(llm, fmt, mixed_prompts())  # again: the prompts' full blocks are cached
    if llm.engine.config.enable_prefix_caching:
        assert llm.stats().prefix_hits > 0 and outs[-1].num_cached_tokens >= 32


def test_one_thread_decodes_in_padded_groups(model_dir, check, monkeypatch):
    """On one CPU thread the sinks' attention takes decodes as padded groups (batched
    matmuls, one call a layer), never one sequence at a time; greedy still equal."""
    calls = []
    monkeypatch.setattr(attention, "_decode_attention", lambda *args: calls.append(args))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check(LLM(model_dir("16-bit")), "16-bit", mixed_prompts())
    finally:
        torch.set_num_threads(threads)
    assert not calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_router_and_experts_equal_transformers(model_dir, fmt):
    hf = hf_sparse_blocks(model_dir(fmt), mixed_prompts()[4], "router", **hf_kwargs(fmt))
    llm = LLM(model_dir(fmt))
    for layer, ref in zip(llm.engine.runner.model.model.layers, hf, strict=True):
        block = layer.mlp
        x = ref["x"].reshape(-1, ref["x"].shape[-1])
        ref_logits, ref_weights, ref_ids = ref["router"]
        with torch.inference_mode():
            weights, ids = block.router(x)
            out = block(x)
            logits = torch.nn.functional.linear(x, block.router.weight, block.router.bias)
        torch.testing.assert_close(logits, ref_logits)
        assert torch.equal(ids, ref_ids)  # both torch.topk over the same logits
        torch.testing.assert_close(weights, ref_weights)
        assert len(ids.unique()) == 8  # the prompt reaches every expert
        torch.testing.assert_close(out, ref["out"][0].reshape(out.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_transformers(model_dir, check, fmt, expert_parallel):
    """Two processes over gloo: each rank a slice of every expert (MXFP4: down's columns
    in whole groups) or, expert parallel, 4 of the 8 whole; the sinks of its 2 heads."""
    llm = LLM(
        model_dir(fmt),
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=24,
    )
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.shard.count == (4 if expert_parallel else 8)
    assert experts.shard.inter == (64 if expert_parallel else 32)
    assert experts.down_proj_bias is not None  # rank 0's
    check(llm, fmt, few_prompts())


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_pipeline_stages_match_transformers(model_dir, check, fmt):
    """Stage 0 (another process) holds the windowed layer, the engine's stage the full
    one and the head, each with its own layer's cache and experts (MXFP4 read by the
    stage that holds them); chunked prefill, then again from the prefix cache."""
    llm = LLM(model_dir(fmt), pipeline_parallel_size=2, max_num_batched_tokens=24)
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[0], MissingLayer) and layers[1].self_attn.window is None
    check(llm, fmt, few_prompts())
    assert check(llm, fmt, few_prompts())[-1].num_cached_tokens >= 32
    llm.engine.close()


def test_fp8_experts_agree_with_the_unquantized_model(model_dir):
    path = model_dir("16-bit")
    prompts = mixed_prompts()[:4]
    refs = LLM(path).generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    llm = LLM(path, quantization="fp8", max_num_batched_tokens=24)
    block = llm.engine.runner.model.model.layers[0].mlp
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert block.router.weight.dtype == torch.float32  # never quantized
    # routing amplifies rounding (top 4 of 8 experts of a random model)
    assert forced_agreement(llm, prompts, refs) >= 0.6


def test_dummy_weights_fill_the_packed_experts(model_dir):
    llm = LLM(model_dir("mxfp4"), load_format="dummy")
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.unique().numel() > 100
    assert 118 <= experts.down_proj_scales.min() <= experts.down_proj_scales.max() < 122
    outs = llm.generate([[5, 6, 7]], GREEDY)
    assert len(outs[0].token_ids) == MAX_NEW


def edited(model_dir: str, tmp_path, change) -> str:
    """A copy of the checkpoint whose config.json `change(config)` edited."""
    path = tmp_path / "edited"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_tied_head_is_left_unpacked(model_dir, tmp_path):
    """The head that is the token table too stays as it is (embedding lookups read it);
    the attention is packed all the same."""
    path = edited(model_dir("16-bit"), tmp_path, lambda c: c.update(tie_word_embeddings=True))
    llm = LLM(path)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_mkldnn
    assert model.model.layers[0].self_attn.o_proj.weight.is_mkldnn
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == MAX_NEW


REFUSED = {
    "attention_chunk_size": lambda c: c.update(attention_chunk_size=128),
    r"layer_types\[1\] 'chunked_attention'": lambda c: c["layer_types"].__setitem__(
        1, "chunked_attention"
    ),
    "rope_parameters.partial_rotary_factor": lambda c: c["rope_parameters"].update(
        partial_rotary_factor=0.5
    ),
    "type 'dynamic' is not supported": lambda c: c["rope_parameters"].update(rope_type="dynamic"),
    "quantization_config.group_size": lambda c: c["quantization_config"].update(group_size=64),
    "modules_to_not_convert 'model.layers.*.mlp'": lambda c: c["quantization_config"][
        "modules_to_not_convert"
    ].append("model.layers.*.mlp"),
    "quantization 'fp4'": lambda c: c["quantization_config"].update(quant_method="fp4"),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_the_engine_cannot_honour_is_refused_by_name(model_dir, tmp_path, field):
    path = edited(model_dir("mxfp4"), tmp_path, REFUSED[field])
    with pytest.raises((ValueError, NotImplementedError), match=field):
        LLM(path)


def test_mxfp4_cut_mid_group_is_refused(model_dir, tmp_path):
    """96 intermediate rows over two ranks: 48 a rank, a group and a half."""
    path = edited(model_dir("mxfp4"), tmp_path, lambda c: c.update(intermediate_size=96))
    with pytest.raises(ValueError, match="mid-group.*enable_expert_parallel"):
        LLM(path, tensor_parallel_size=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_on_cuda_matches_transformers(model_dir, check, dtype):
    """The MXFP4 experts through their Triton kernel, the sinks through the attention
    kernels, decodes in CUDA graphs: float32 equal to transformers' greedy output on the
    CPU; bfloat16 agreeing with float32 on most forced tokens."""
    path = model_dir("mxfp4")
    pool = {"kv_cache_memory_bytes": 64 << 20, "max_num_batched_tokens": 24}
    llm = LLM(path, device="cuda", dtype=dtype, **pool)
    assert llm.engine.runner.paged_kernels and llm.engine.runner.graphs is not None
    if dtype == "float32":
        check(llm, "mxfp4", mixed_prompts())
    else:
        refs = LLM(path, device="cuda", dtype="float32", **pool).generate(mixed_prompts(), GREEDY)
        assert forced_agreement(llm, mixed_prompts(), refs) >= 0.75
    assert llm.engine.runner.num_graph_steps > 0
