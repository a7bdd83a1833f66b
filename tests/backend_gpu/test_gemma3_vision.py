"""Gemma 3's vision on the engine (a tiny seeded random Gemma3ForConditionalGeneration saved
with save_pretrained and loaded from that directory): greedy output equal to transformers'
with one and two images in the prompt (their soft tokens attending to each other both
ways, the sliding layers' window shorter than an image), whole and in chunks (which never
end inside an image), again from the prefix cache (hits ending inside an image) and the
encoder cache, and under preemption; from the hub's and transformers 4's tensor names
too; the image preprocessing equal to transformers' Gemma 3 image processor bit for bit;
prefix caching by the image's content; the settings the vision path does not take
serving the text model alone; a step budget below an image refused (kvgate plan counting
the tower: test_gemma3_multimodal.py)."""

from __future__ import annotations

import shutil
from importlib import resources

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

from backend_gpu import LLM, SamplingParams
from backend_gpu.image_processing import Gemma3ImageProcessor
from backend_gpu.models.gemma3 import Gemma3ForCausalLM
from backend_gpu.models.gemma3_vision import Gemma3VisionForConditionalGeneration as Ours
from engine_api.images import ImageInput
from engine_api.records import GenRequest
from tests.backend_gpu.reference import assert_greedy_matches
from tests.backend_gpu.tiny_gemma3_vision import (
    TOKENS_PER_IMAGE,
    hf_image_processor,
    save_tiny_gemma3_vision,
)
from tests.backend_gpu.tiny_qwen2_5_vl import scene, scene_input

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
SETTINGS = {
    # chunks of 24 would end inside the images: they end before them instead
    "chunked+prefix": dict(max_num_batched_tokens=24),
    "whole-prefill,no-prefix-cache": dict(
        enable_chunked_prefill=False, enable_prefix_caching=False, max_num_batched_tokens=256
    ),
}
RED = scene_input(300, 200, 1)
BLUE = scene_input(90, 60, 2)
SAME_SIZE_AS_RED = scene_input(300, 200, 7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_gemma3_vision(str(tmp_path_factory.mktemp("gemma3_vision")))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def prompt_of(tokenizer, parts: list) -> tuple[list[int], list[ImageInput]]:
    """Text and images in order, each image as Gemma 3's processor writes it
    ("\\n\\n<start_of_image>", its soft tokens, "<end_of_image>\\n\\n"), tokenized whole."""
    soft = "<image_soft_token>" * TOKENS_PER_IMAGE
    full = f"\n\n<start_of_image>{soft}<end_of_image>\n\n"
    text = "".join(full if isinstance(part, ImageInput) else part for part in parts)
    images = [part for part in parts if isinstance(part, ImageInput)]
    return tokenizer.encode(text), images


PROMPTS = {
    "one image": ["The quick brown fox", RED, "Paged attention stores keys"],
    "two images": ["Numbers: 0 1 2", RED, "and", BLUE, "def generate(prompts):"],
    "image first": [BLUE, "Continuous batching lets requests join"],
}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [prompt_of(tokenizer, parts) for parts in PROMPTS.values()]


@pytest.fixture(scope="module")
def references(model_dir, prompts):
    """transformers' greedy tokens and logits, its own processor giving the pixels and
    token_type_ids marking the soft tokens (its bidirectional mask)."""
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    processor = hf_image_processor()
    soft = model.config.image_token_id
    results = []
    with torch.inference_mode():
        for tokens, images in prompts:
            pictures = [Image.frombytes("RGB", (im.width, im.height), im.rgb) for im in images]
            pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
            ids = torch.tensor([tokens])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                token_type_ids=(ids == soft).long(),
                pixel_values=pixels,
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


def image_spans(tokens: list[int], soft: int) -> list[tuple[int, int]]:
    """[start, end) of each run of soft tokens."""
    spans, i = [], 0
    while i < len(tokens):
        if tokens[i] == soft:
            j = i
            while j < len(tokens) and tokens[j] == soft:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(model_dir, prompts, references, setting):
    llm = LLM(model_dir, **SETTINGS[setting])
    assert isinstance(llm.engine.runner.model, Ours)
    for _ in range(2):  # again: the prompts' blocks are cached, the images too
        outs = generate(llm, prompts)
        for out, (ref_ids, ref_logits) in zip(outs, references, strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    soft = llm.engine.hf_config.image_token_id
    if llm.engine.config.enable_prefix_caching:  # every full block but the last token's
        cached = [(len(tokens) - 1) // 16 * 16 for tokens, _ in prompts]
        assert [out.num_cached_tokens for out in outs] == cached
    for out, (tokens, _) in zip(outs, prompts, strict=True):
        assert out.num_image_tokens == tokens.count(soft) > 0
    assert llm.stats().encoder_cache_hits > 0


def test_greedy_under_preemption(model_dir, prompts, references):
    """A pool of 8 blocks for the three prompts and their outputs: a preempted sequence
    computes its images again, whole."""
    llm = LLM(model_dir, kv_cache_memory_bytes=8 * 12288, max_model_len=128)
    assert llm.stats().num_blocks == 8
    for out, (ref_ids, ref_logits) in zip(generate(llm, prompts), references, strict=True):
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    assert llm.stats().preemptions > 0


def test_chunks_end_before_an_image_they_would_cut(model_dir, prompts):
    """Chunks of 24 through the two-image prompt: every chunk ends outside the images
    (the one before an image is cut short), and the output and the prompt's logprobs are
    the whole prefill's."""
    tokens, images = prompts[1]
    llm = LLM(model_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    want = LLM(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=256)
    engine = llm.engine
    scored = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    engine.add_request(GenRequest("r", "", tokens, scored, images=images))
    ends, out, first = [], None, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        first = first or next((o for o in outs if o.prompt_logprobs), None)
        seq = engine.seqs.get("r")
        if seq is not None and seq.num_computed_tokens <= len(tokens):
            ends.append(seq.num_computed_tokens)
        out = next((o for o in outs if o.finished), out)
    spans = image_spans(tokens, engine.hf_config.image_token_id)
    prefill = [e for e in ends if e < len(tokens)]
    assert prefill and all(not a < e < b for e in prefill for a, b in spans)
    assert any(e < 24 * (i + 1) for i, e in enumerate(prefill))  # some chunk was cut short
    ref = want.generate([tokens], scored, images=[images])[0]
    assert out.token_ids == ref.token_ids
    ours, whole = ([p.logprob for p in o.prompt_logprobs[1:]] for o in (first, ref))
    np.testing.assert_allclose(ours, whole, atol=1e-4)


def test_prefix_cache_hits_by_the_image_shown(model_dir, tokenizer):
    """The same image is a hit, another image of the same size is not past the block
    its soft tokens start in; each output is the one computed without a cache."""
    llm = LLM(model_dir, max_num_batched_tokens=64)
    text = ["The quick brown fox jumps over the lazy dog.", RED, "Déjà vu, naïve façade."]
    red, images = prompt_of(tokenizer, text)
    blue, other = prompt_of(tokenizer, [text[0], SAME_SIZE_AS_RED, text[2]])
    assert red == blue and images != other
    fresh = LLM(model_dir, enable_prefix_caching=False)
    want_red, want_blue = (
        fresh.generate([red], GREEDY, images=[ims])[0] for ims in (images, other)
    )
    assert want_red.token_ids != want_blue.token_ids  # the image changes the output
    assert llm.generate([red], GREEDY, images=[images])[0].token_ids == want_red.token_ids
    again = llm.generate([red], GREEDY, images=[images])[0]
    assert again.num_cached_tokens == (len(red) - 1) // 16 * 16
    assert again.token_ids == want_red.token_ids
    different = llm.generate([blue], GREEDY, images=[other])[0]
    soft = llm.engine.hf_config.image_token_id
    assert different.num_cached_tokens == red.index(soft) // 16 * 16
    assert different.token_ids == want_blue.token_ids


def test_a_prefix_hit_ending_inside_an_image(model_dir, tokenizer):
    """Another question on the same picture: the cached blocks end inside the image (its
    keys were computed seeing all of it), the rest of the image is computed in one chunk
    seeing them; the output is the one computed without a cache."""
    llm = LLM(model_dir, max_num_batched_tokens=32)
    fresh = LLM(model_dir, enable_prefix_caching=False)
    soft = llm.engine.hf_config.image_token_id
    for head in ("Numbers: 0 1 2", "The quick brown fox", "def generate(prompts)", "Un café"):
        first, images = prompt_of(tokenizer, [head, RED, "Paged attention stores keys"])
        second, _ = prompt_of(tokenizer, [head, RED, "Continuous batching lets requests join"])
        (start, end), shared = image_spans(first, soft)[0], 0
        while first[shared] == second[shared]:
            shared += 1
        if start < shared // 16 * 16 < end:
            break
    else:
        raise AssertionError("no prompt puts a block boundary inside its image")
    llm.generate([first], GREEDY, images=[images])
    out = llm.generate([second], GREEDY, images=[images])[0]
    assert start < out.num_cached_tokens < end
    assert out.token_ids == fresh.generate([second], GREEDY, images=[images])[0].token_ids


def test_the_hubs_and_transformers_4s_tensor_names_load_alike(model_dir, prompts, tmp_path):
    """The tower as the hub has it (vision_tower.vision_model.*) and as transformers 4
    saved the whole model (model.vision_tower.vision_model.*,
    model.multi_modal_projector.*, model.language_model.*): the same output."""
    tokens, images = prompts[1]
    want = LLM(model_dir).generate([tokens], GREEDY, images=[images])[0].token_ids
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    hub = {
        n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in stored.items()
    }
    v4 = {
        "model." + n.replace("language_model.model.", "language_model.", 1): t
        for n, t in hub.items()
    }
    assert "model.vision_tower.vision_model.embeddings.patch_embedding.weight" in v4
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in v4
    for name, tensors in (("hub", hub), ("v4", v4)):
        path = tmp_path / name
        shutil.copytree(model_dir, path)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        got = LLM(str(path)).generate([tokens], GREEDY, images=[images])[0].token_ids
        assert got == want, name


def photo(name: str) -> Image.Image:
    with resources.as_file(resources.files("sklearn.datasets") / "images" / name) as path:
        return Image.open(path).convert("RGB")


IMAGES = {
    "china.jpg": lambda: photo("china.jpg"),  # 640x427: scaled down, squashed
    "scene-300x200": lambda: scene(300, 200, 1),
    "scene-31x97": lambda: scene(31, 97, 2),  # scaled up
    "scene-64x64": lambda: scene(64, 64, 3),  # already the size
}


@pytest.mark.parametrize("size", [64, 896], ids=["tiny", "gemma3-default"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_equal_transformers(name, size):
    image = IMAGES[name]()
    ours = Gemma3ImageProcessor(height=size, width=size, patch_size=8 if size == 64 else 14)
    ref = hf_image_processor(size)(images=[image], return_tensors="np")["pixel_values"]
    width, height = image.size
    pixels = ours.patches(width, height, image.tobytes())
    assert pixels.dtype == np.float32 and pixels.shape == (3, size, size)
    np.testing.assert_array_equal(pixels, ref[0])
    assert ours.num_tokens(width, height) == 256


def test_the_model_directory_sets_the_processor(model_dir, tmp_path):
    processor = Gemma3ImageProcessor.from_dir(model_dir)
    assert (processor.height, processor.patch_size, processor.tokens) == (64, 8, 16)
    assert processor.grid(300, 200) == processor.largest_grid() == (1, 8, 8)
    (tmp_path / "preprocessor_config.json").write_text('{"do_pan_and_scan": true}')
    with pytest.raises(ValueError, match="pan-and-scan"):
        Gemma3ImageProcessor.from_dir(str(tmp_path))


def test_settings_without_images_serve_the_text_model(model_dir, prompts):
    """LoRA (and tensor or pipeline parallelism, speculative decoding) serve Gemma 3's
    text alone, as before its vision was served; a budget below an image is refused."""
    llm = LLM(model_dir, enable_lora=True)
    model = llm.engine.runner.model
    assert type(model) is Gemma3ForCausalLM and llm.engine.runner.vision is None
    tokens, _ = prompt_of(llm.engine.tokenizer, ["The quick brown fox"])
    assert len(llm.generate([tokens], GREEDY)[0].token_ids) == MAX_NEW
    with pytest.raises(ValueError, match="max_num_batched_tokens 8 is below an image's 16"):
        LLM(model_dir, max_num_batched_tokens=8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_on_cuda_matches_transformers_on_the_cpu(model_dir, prompts, references):
    """The Triton prefill kernel with an image's rows seeing ahead, chunks of 24, the
    prefix cache on the second pass; decodes in CUDA graphs."""
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=24,
    )
    assert llm.engine.runner.paged_kernels
    for _ in range(2):
        outs = generate(llm, prompts)
        for out, (ref_ids, ref_logits) in zip(outs, references, strict=True):
            assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    assert llm.engine.runner.num_graph_steps > 0
