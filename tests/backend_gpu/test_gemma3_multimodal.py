"""Gemma 3 as published (4B/12B/27B: Gemma3ForConditionalGeneration, a text model beside a
SigLIP vision tower) served from those files on text prompts: greedy output equal to
transformers' multimodal model under chunked prefill, prefix caching and whole
prefills, from the hub's tensor names and from transformers 4's; a text model reading
none of the tower; two ranks and two pipeline stages (the text model alone); FP8
weights; an unknown rope type refused naming the field; and kvgate plan of Gemma 3 4B
counting its text model and its tower (its images: test_gemma3_vision.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from backend_gpu import LLM, SamplingParams
from backend_gpu.loader import Checkpoint
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory
from backend_gpu.models.gemma3 import Gemma3ForCausalLM
from backend_gpu.pp_stages import MissingLayer
from tests.backend_gpu.reference import forced_agreement
from tests.backend_gpu.test_correctness import SETTINGS, check, mixed_prompts

GIB = 1 << 30


def test_the_reference_is_transformers_multimodal_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gemma3_mm"))
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(tiny_model_dir, setting):
    model_dir = tiny_model_dir("gemma3_mm")
    llm = LLM(model_dir, **SETTINGS[setting])
    model = llm.engine.runner.model
    assert isinstance(model, Gemma3ForCausalLM)
    assert llm.engine.hf_config.model_type == "gemma3_text"
    # the global layer's rope is linearly scaled, as Gemma 3 4B's
    assert model.model.layers[1].self_attn.rotary.settings[3]["factor"] == 8.0
    assert model.model.layers[0].self_attn.window == 16
    check(llm, model_dir)
    outs = check(llm, model_dir)  # again: the prompts' full blocks are cached
    if llm.engine.config.enable_prefix_caching:
        assert outs[-1].num_cached_tokens >= 32


def test_the_vision_tower_is_not_read(tiny_model_dir):
    """Not by a text model's read (Gemma3VisionForConditionalGeneration asks for it)."""
    path = tiny_model_dir("gemma3_mm")
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        stored = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in stored)
    assert any(n.startswith("multi_modal_projector.") for n in stored)
    names = [name for name, _ in Checkpoint(path).tensors()]
    text = [n for n in stored if n.startswith("language_model.")]
    assert sorted(names) == sorted("model." + n[len("language_model.model.") :] for n in text)


def test_transformers_4_tensor_names_load_alike(tiny_model_dir, tmp_path):
    """model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*: how
    transformers 4.5x saves the same model."""
    path = tmp_path / "gemma3-v4-names"
    shutil.copytree(tiny_model_dir("gemma3_mm"), path)
    tensors = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            text = name.removeprefix("language_model.model.")
            new = f"model.language_model.{text}" if text != name else f"model.{name}"
            tensors[new] = f.get_tensor(name)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "model.vision_tower.embeddings.patch_embedding.weight" in tensors
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = mixed_prompts()[:3]
    want = LLM(tiny_model_dir("gemma3_mm")).generate(prompts, params)
    got = LLM(str(path)).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_two_ranks_match_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("gemma3_mm")
    llm = LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=24)
    assert llm.engine.runner.attention_layers[0].num_heads == 2
    check(llm, model_dir)


def test_two_pipeline_stages_match_transformers(tiny_model_dir):
    """The multimodal checkpoint's text tensors read per stage: a windowed and the
    global layer on stage 0 (another process), the other windowed one on the engine's."""
    model_dir = tiny_model_dir("gemma3_mm")
    llm = LLM(model_dir, pipeline_parallel_size=2, max_num_batched_tokens=24)
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[1], MissingLayer) and layers[2].self_attn.window == 16
    check(llm, model_dir)
    llm.engine.close()


def test_fp8_weights_agree_with_the_unquantized_model(tiny_model_dir):
    path = tiny_model_dir("gemma3_mm")
    prompts = mixed_prompts()[:4]
    refs = LLM(path).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    llm = LLM(path, quantization="fp8", max_num_batched_tokens=24)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype.itemsize == 1
    assert forced_agreement(llm, prompts, refs) >= 0.75


def test_an_unknown_rope_type_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    path = tmp_path / "gemma3"
    shutil.copytree(tiny_model_dir("gemma3_mm"), path)
    config = json.loads((path / "config.json").read_text())
    rope = config["text_config"]["rope_parameters"]
    rope["full_attention"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="rope_scaling .*type 'dynamic'"):
        LLM(str(path))


# google/gemma-3-4b-it's config.json (the fields the engine reads)
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
    "mm_tokens_per_image": 256,
}


def test_plan_of_gemma3_4b_counts_its_text_model_and_tower(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_4B))
    device = PlanDevice("h100-80gb", 80 * GIB, 0)
    plan = plan_memory(str(path), device, PlanSettings(kv_cache_memory_bytes=GIB))
    assert plan.architecture == "Gemma3ForConditionalGeneration"
    h, layers, vocab, head = 2560, 34, 262208, 256
    attention = h * (8 * head) * 2 + h * (4 * head) * 2 + 2 * head  # q, o; k, v; q/k norms
    per_layer = attention + 3 * h * 10240 + 4 * h  # the MLP; four norms
    text = layers * per_layer + vocab * h + h
    assert text == 3_880_263_168
    # the SigLIP tower (patches, positions, 27 layers, the last norm) and the projector
    v, inter = 1152, 4304
    tower = (
        3 * 14 * 14 * v + v + 64 * 64 * v + 27 * (4 * (v * v + v) + 2 * v * inter + inter + 5 * v)
    )
    assert plan.parameters == text + tower + 2 * v + v * h + v == 4_300_079_472
    # two ranks serve its text alone: no tower, no image's activations
    two = plan_memory(
        str(path), device, PlanSettings(kv_cache_memory_bytes=GIB, tensor_parallel_size=2)
    )
    assert two.ranks[0].activation_bytes < plan.ranks[0].activation_bytes
    # every sixth layer global (Gemma 3's default pattern), the others a 1024 window
    assert plan.sliding_window == 1024 and plan.sliding_layers == layers - layers // 6
