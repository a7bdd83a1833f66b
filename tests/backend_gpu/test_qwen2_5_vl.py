"""Qwen2.5-VL on the engine (a tiny seeded random model saved with save_pretrained and
loaded from that directory): greedy output equal to transformers'
Qwen2_5_VLForConditionalGeneration with one and two images in the prompt, whole and in
chunks that cut through an image, again from the prefix cache (decodes continue at the
M-RoPE offset); prefix caching by the image's content (the same image a hit, another
image of the same size never, another tenant's same image not); the encoder cache
(a repeated image not encoded again, per tenant, bounded); usage's image tokens; and the
refusals (a text model given images, placeholders that do not fit)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from backend_gpu.image_processing import Qwen2VLImageProcessor
from backend_gpu.kv_budget import KVSizing
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory, vision_bytes
from backend_gpu.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Ours
from engine_api.errors import BadRequestError
from engine_api.images import ImageInput
from engine_api.records import GenRequest
from tests.backend_gpu.reference import assert_greedy_matches
from tests.backend_gpu.tiny_qwen2_5_vl import (
    MAX_PIXELS,
    hf_image_processor,
    save_tiny_qwen2_5_vl,
    scene_input,
)

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
SETTINGS = {
    # chunks of 16 cut the images (24 and 36 placeholder tokens) in pieces
    "chunked+prefix": dict(max_num_batched_tokens=16),
    "whole-prefill,no-prefix-cache": dict(
        enable_chunked_prefill=False, enable_prefix_caching=False, max_num_batched_tokens=256
    ),
}
RED = scene_input(300, 200, 1)  # 24 tokens at the tiny bounds
BLUE = scene_input(90, 60, 2)
SAME_SIZE_AS_RED = scene_input(300, 200, 7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def prompt_of(tokenizer, model_dir: str, parts: list) -> tuple[list[int], list[ImageInput]]:
    """Token ids of text and images in order, each image as Qwen's placeholders."""
    processor = Qwen2VLImageProcessor.from_dir(model_dir)
    ids = tokenizer.convert_tokens_to_ids
    tokens: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, str):
            tokens += tokenizer.encode(part)
            continue
        images.append(part)
        n = processor.num_tokens(part.width, part.height)
        tokens += [ids("<|vision_start|>"), *[ids("<|image_pad|>")] * n, ids("<|vision_end|>")]
    return tokens, images


PROMPTS = {
    "one image": ["The quick brown fox", RED, "Paged attention stores keys"],
    "two images": ["Numbers: 0 1 2", RED, "and", BLUE, "def generate(prompts):"],
    "image first": [BLUE, "Continuous batching lets requests join"],
}


@pytest.fixture(scope="module")
def prompts(tokenizer, model_dir):
    return [prompt_of(tokenizer, model_dir, parts) for parts in PROMPTS.values()]


@pytest.fixture(scope="module")
def references(model_dir, prompts):
    """transformers' greedy tokens and logits, its own processor giving the pixels."""
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    processor = hf_image_processor()
    pad = model.config.image_token_id
    results = []
    with torch.inference_mode():
        for tokens, images in prompts:
            pictures = [Image.frombytes("RGB", (im.width, im.height), im.rgb) for im in images]
            pixels = processor(images=pictures, return_tensors="pt")
            ids = torch.tensor([tokens])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == pad).int(),
                pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            results.append((out.sequences[0, len(tokens) :].tolist(), torch.cat(out.logits)))
    return results


def generate(llm: LLM, prompts) -> list:
    return llm.generate([t for t, _ in prompts], GREEDY, images=[im for _, im in prompts])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(model_dir, prompts, references, setting):
    llm = LLM(model_dir, **SETTINGS[setting])
    assert isinstance(llm.engine.runner.model, Ours)
    for _ in range(2):  # again: the prompts' blocks are cached, the images too
        outs = generate(llm, prompts)
        for out, (ref_ids, ref_logits) in zip(outs, references, strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    if llm.engine.config.enable_prefix_caching:  # every full block but the last token's
        cached = [(len(tokens) - 1) // 16 * 16 for tokens, _ in prompts]
        assert [out.num_cached_tokens for out in outs] == cached
        assert min(cached) > 0
    pad = llm.engine.hf_config.image_token_id
    for out, (tokens, _) in zip(outs, prompts, strict=True):
        assert out.num_image_tokens == tokens.count(pad) > 0


def test_greedy_under_preemption(model_dir, prompts, references):
    """A pool of 8 blocks for three prompts of 3, 5 and 2 blocks and their outputs: a
    preempted sequence computes its images and positions again."""
    llm = LLM(model_dir, kv_cache_memory_bytes=8 * 8192, max_model_len=128)
    assert llm.stats().num_blocks == 8
    for out, (ref_ids, ref_logits) in zip(generate(llm, prompts), references, strict=True):
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    assert llm.stats().preemptions > 0


def test_resize_image_pixels_lowers_the_largest_image(model_dir, caplog):
    llm = LLM(model_dir, resize_image_pixels=28 * 28 * 8)
    processor = llm.engine.runner.vision.processor
    assert processor.max_pixels == 28 * 28 * 8
    assert processor.num_tokens(RED.width, RED.height) == 6  # 24 at the model's own bound
    with pytest.raises(ValueError, match="resize_image_pixels"):
        LLM(model_dir, resize_image_pixels=100)
    # the older name (the gateway's refusing limit's too) is taken, with a warning
    with caplog.at_level(logging.WARNING, "backend_gpu.config"):
        config = EngineConfig(model_dir, max_image_pixels=28 * 28 * 8)
    assert (config.resize_image_pixels, config.max_image_pixels) == (28 * 28 * 8, None)
    assert "max_image_pixels on the gpu engine is deprecated" in caplog.text
    with pytest.raises(ValueError, match="not also max_image_pixels"):
        EngineConfig(model_dir, max_image_pixels=1000, resize_image_pixels=1000)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 does not work with vision"):
        LLM(model_dir, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config does not work with vision"):
        LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def run(llm: LLM, tokens: list[int], images: list[ImageInput], salt: str | None = None):
    """One request to its end through the engine, under cache salt `salt`."""
    engine = llm.engine
    request_id = f"r{engine.stats().num_steps}-{salt}-{len(images)}"
    engine.add_request(GenRequest(request_id, "", tokens, GREEDY, cache_salt=salt, images=images))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


@pytest.fixture(scope="module")
def cached_llm(model_dir) -> LLM:
    return LLM(model_dir, max_num_batched_tokens=64)


def test_prefix_cache_hits_by_the_image_shown(cached_llm, tokenizer, model_dir):
    """The same image is a hit, a different image with the same placeholders is not
    (cached only up to the block its placeholders start in), another tenant's same
    image is not; each output is the one computed without a cache."""
    llm = cached_llm
    text = ["The quick brown fox jumps over the lazy dog.", RED, "Déjà vu, naïve façade."]
    red, images = prompt_of(tokenizer, model_dir, text)
    blue, other = prompt_of(tokenizer, model_dir, [text[0], SAME_SIZE_AS_RED, text[2]])
    assert red == blue and images != other  # the very same token ids
    pad = llm.engine.hf_config.image_token_id
    first_block_of_image = red.index(pad) // 16 * 16
    assert first_block_of_image >= 16
    fresh = LLM(model_dir, enable_prefix_caching=False)
    want_red = run(fresh, red, images).token_ids
    want_blue = run(fresh, blue, other).token_ids
    assert want_red != want_blue  # the image changes the output

    assert run(llm, red, images, "tenant-a").token_ids == want_red
    again = run(llm, red, images, "tenant-a")
    assert again.num_cached_tokens == (len(red) - 1) // 16 * 16
    assert again.token_ids == want_red
    different = run(llm, blue, other, "tenant-a")
    assert different.num_cached_tokens == first_block_of_image
    assert different.token_ids == want_blue
    other_tenant = run(llm, red, images, "tenant-b")
    assert other_tenant.num_cached_tokens == 0
    assert other_tenant.token_ids == want_red


def test_the_host_tier_keys_blocks_by_the_image_too(model_dir, tokenizer):
    """Blocks evicted to the host tier come back for the same image, never for another
    image of the same size (the tier keeps the device's keys)."""
    llm = LLM(model_dir, kv_cache_memory_bytes=8 * 8192, max_model_len=128, kv_offload_gb=0.01)
    text = ["The quick brown fox jumps over the lazy dog.", RED, "Déjà vu, naïve façade."]
    red, images = prompt_of(tokenizer, model_dir, text)
    _, other = prompt_of(tokenizer, model_dir, [text[0], SAME_SIZE_AS_RED, text[2]])
    filler, none = prompt_of(tokenizer, model_dir, ["Numbers: 0 1 2 3 4 5 6 7 8 9 10 42" * 4])
    want = run(llm, red, images, "a").token_ids
    run(llm, filler, none, "a")  # the device's 8 blocks go to the host tier
    again = run(llm, red, images, "a")
    assert again.num_cached_tokens == (len(red) - 1) // 16 * 16 and again.token_ids == want
    assert llm.stats().kv_host_hits > 0
    run(llm, filler, none, "a")
    pad = llm.engine.hf_config.image_token_id
    assert run(llm, red, other, "a").num_cached_tokens == red.index(pad) // 16 * 16


def test_the_encoder_cache_encodes_a_repeated_image_once_per_tenant(model_dir, tokenizer):
    llm = LLM(model_dir, enable_prefix_caching=False)
    tokens, images = prompt_of(tokenizer, model_dir, ["Numbers:", RED, "and", BLUE, "?"])
    cache = llm.engine.runner.vision.cache
    first = run(llm, tokens, images, "a")
    assert (cache.misses, cache.hits) == (2, 0)
    assert run(llm, tokens, images, "a").token_ids == first.token_ids
    assert (cache.misses, cache.hits) == (2, 2)  # nothing encoded again
    assert llm.stats().encoder_cache_hits == 2
    run(llm, tokens, images, "b")  # another tenant: its own encodes
    assert (cache.misses, cache.hits) == (4, 2)
    assert cache.tokens == 2 * (24 + 6)


def test_the_encoder_cache_is_bounded(model_dir, tokenizer):
    llm = LLM(model_dir, enable_prefix_caching=False, encoder_cache_tokens=30)
    tokens, images = prompt_of(tokenizer, model_dir, ["Numbers:", RED, "and", BLUE, "?"])
    run(llm, tokens, images)
    cache = llm.engine.runner.vision.cache
    assert cache.tokens <= 30 and (cache.misses, cache.hits) == (2, 0)
    solo, one = prompt_of(tokenizer, model_dir, ["x", SAME_SIZE_AS_RED])
    run(llm, solo, one)  # 24 more tokens: the least recently used (RED's 24) go
    assert cache.tokens == 30
    assert list(cache.entries) == [(None, BLUE.digest), (None, SAME_SIZE_AS_RED.digest)]


def test_refusals_change_nothing(model_dir, tokenizer, tiny_model_dir, cached_llm):
    tokens, images = prompt_of(tokenizer, model_dir, ["Numbers:", RED, "?"])
    text_model = LLM(tiny_model_dir("qwen2"))
    with pytest.raises(BadRequestError, match="does not take images"):
        text_model.generate([tokens[:5]], GREEDY, images=[images])
    engine = cached_llm.engine
    with pytest.raises(BadRequestError, match="1 image placeholders for 2 images"):
        engine.add_request(GenRequest("x", "", tokens, GREEDY, images=[RED, BLUE]))
    with pytest.raises(BadRequestError, match="takes 6 placeholder tokens, the prompt has 24"):
        engine.add_request(GenRequest("x", "", tokens, GREEDY, images=[BLUE]))
    with pytest.raises(BadRequestError, match="1 image placeholders for 0 images"):
        engine.add_request(GenRequest("x", "", tokens, GREEDY))
    torn = ImageInput(RED.digest, RED.width, RED.height, RED.rgb[:-3])
    with pytest.raises(BadRequestError, match="pixels do not fill its size"):
        engine.add_request(GenRequest("x", "", tokens, GREEDY, images=[torn]))
    wide = ImageInput(RED.digest, 2010, 10, bytes(2010 * 10 * 3))
    with pytest.raises(BadRequestError, match="aspect ratio"):
        engine.add_request(GenRequest("x", "", tokens, GREEDY, images=[wide]))
    assert not engine.seqs and not engine.has_unfinished_requests()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_on_cuda_matches_transformers_on_the_cpu(model_dir, prompts, references):
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=16,
    )
    for _ in range(2):
        outs = generate(llm, prompts)
        for out, (ref_ids, ref_logits) in zip(outs, references, strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    assert llm.engine.runner.num_graph_steps > 0  # decodes at the M-RoPE offset, in graphs


def test_memory_counts_the_tower_and_one_encoder_batch(model_dir, cached_llm):
    """The engine's weights and `kvgate plan`'s are the tower's and the decoder's; the
    plan's activations add one image at the processor's limit and the encoder cache."""
    model = cached_llm.engine.runner.model
    tower = sum(p.numel() for p in model.visual.parameters())
    assert tower > 0
    assert cached_llm.stats().weight_bytes == 4 * sum(p.numel() for p in model.parameters())
    device = PlanDevice("h100-80gb", 80 << 30, 0)
    vision = PlanSettings(dtype="bfloat16")
    plan = plan_memory(model_dir, device, vision)
    assert plan.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert plan.parameters == sum(p.numel() for p in model.parameters())
    config = cached_llm.engine.hf_config
    reserve = vision_bytes(config, 2)
    # one 1280-token image (5120 patches) through the tower, and 16384 cached tokens
    assert reserve >= 5120 * 3 * 2 * 14 * 14 * 4 + 16384 * config.hidden_size * 2
    assert plan.ranks[0].activation_bytes >= reserve
    # what the CUDA profile encodes (the largest image at the bounds), here on the CPU
    grid = cached_llm.engine.runner.vision.processor.largest_grid()
    assert grid[1] * grid[2] * 196 <= MAX_PIXELS
    sizing = SimpleNamespace(vision_grid=grid, hf_config=config, device="cpu", model=model)
    out = KVSizing.encode_largest_image(sizing)
    assert out.shape == (grid[0] * grid[1] * grid[2] // 4, config.hidden_size)
