"""The gateway's gpu adapter over a vision model (the tiny Qwen2.5-VL): its card says it
takes images; a chat's image parts render as each image's placeholder run where the image
stood; the request generates what the engine gives those ids and images, and its usage
counts the image tokens; the block hashes the router sees are the engine's (keyed by the
image); a pad token in the client's own text is a 400."""

from __future__ import annotations

import pytest

from backend_gpu.image_processing import Qwen2VLImageProcessor
from engine_api.images import image_input
from gateway.backends import BackendSpec, BadRequestError, GenRequest, SamplingParams, build_backend
from gateway.backends.vision_render import widen_placeholders
from tests.backend_gpu.tiny_qwen2_5_vl import save_tiny_qwen2_5_vl, scene_input

RED = scene_input(300, 200, 1)
BLUE = scene_input(300, 200, 7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture
async def backend(model_dir):
    spec = BackendSpec(name="vl0", type="gpu", model=model_dir, options={"seed": 1})
    backend = build_backend(spec)
    await backend.start()
    yield backend
    await backend.stop(drain=False)


def chat(image) -> list[dict]:
    parts = [
        {"type": "text", "text": "What is in"},
        {"type": "image", "image": image},
        {"type": "text", "text": "this picture?"},
    ]
    return [{"role": "user", "content": parts}]


async def test_images_render_as_their_placeholders_and_count_in_usage(backend, model_dir):
    (card,) = backend.models()
    assert card.vision
    model = card.id
    ids = await backend.render(model, chat(RED))
    config = backend.engine.engine.hf_config
    pad = config.image_token_id
    n = Qwen2VLImageProcessor.from_dir(model_dir).num_tokens(RED.width, RED.height)
    start = ids.index(pad)
    assert ids[start - 1] == config.vision_start_token_id
    assert ids[start : start + n] == [pad] * n and ids[start + n] == config.vision_end_token_id
    text = backend.engine.tokenizer.decode([t for t in ids if t != pad])
    assert "What is in" in text and "this picture?" in text
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    req = GenRequest("r1", model, ids, params, cache_salt="t", images=[RED])
    chunks = [c async for c in backend.generate(req)]
    usage = chunks[-1].usage
    assert usage.image_tokens == n and usage.prompt_tokens == len(ids)
    extra = backend.stats().extra
    assert (extra["encoder_cache_misses"], extra["encoder_cache_hits"]) == (1, 0)
    # the router's keys are the engine's: another image with the same ids shares none
    # of the blocks its placeholders touch
    red = backend.block_hashes(ids, "t", images=[RED])
    blue = backend.block_hashes(ids, "t", images=[BLUE])
    first = start // 16
    assert red[:first] == blue[:first] and not set(red[first:]) & set(blue[first:])
    assert red == [h.hex() for h in backend.engine.engine.prompt_keys(req)][: len(red)]


async def test_a_pad_token_in_the_text_is_refused(backend):
    model = backend.models()[0].id
    messages = chat(RED)
    messages[0]["content"][0]["text"] = "<|image_pad|> sneaks in"
    with pytest.raises(BadRequestError, match="2 image placeholders for 1 images"):
        await backend.render(model, messages)
    assert widen_placeholders([1, 9, 2, 9], 9, [2, 1]) == [1, 9, 9, 2, 9]
    with pytest.raises(BadRequestError, match="aspect ratio"):
        await backend.render(model, chat(image_input(2010, 10, bytes(2010 * 10 * 3))))
