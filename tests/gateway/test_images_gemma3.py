"""Gemma 3's images end to end on the real engine: a gateway serving the tiny Gemma 3 with
its vision (tests/backend_gpu/tiny_gemma3_vision.py) on the gpu backend (CPU here), the
official `openai` client sending drawn pictures as PNGs. A chat's image parts render as
Gemma 3's processor writes them into its template's text ("\\n\\n<start_of_image>", the
soft tokens, "<end_of_image>\\n\\n", then tokenized whole): the same ids as transformers'
template and processor; usage counts the soft tokens; the same picture again is a prefix
hit, another of the same size is not past its soft tokens; the answer is the engine's on
those ids; a <start_of_image> in the client's own text is a 400."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from transformers import AutoTokenizer

from backend_gpu import LLM, SamplingParams
from engine_api.images import image_input
from gateway.backends import BackendSpec, BadRequestError, build_backend
from tests.backend_gpu.tiny_gemma3_vision import TOKENS_PER_IMAGE, save_tiny_gemma3_vision
from tests.backend_gpu.tiny_qwen2_5_vl import scene

QUESTION = "What is in this picture, and what colour is the house?"


def encoded(seed: int) -> str:
    out = io.BytesIO()
    scene(300, 200, seed).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_gemma3_vision(str(tmp_path_factory.mktemp("gemma3_vision")))


def transformers_ids(model_dir: str, content: list[dict]) -> list[int]:
    """transformers' way: the template over the message's parts, each image's
    <start_of_image> widened as Gemma3Processor does, the text tokenized whole."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    soft = "<image_soft_token>" * TOKENS_PER_IMAGE
    text = text.replace("<start_of_image>", f"\n\n<start_of_image>{soft}<end_of_image>\n\n")
    return tokenizer.encode(text, add_special_tokens=False)


async def test_a_chat_renders_as_gemma3s_processor_does(model_dir):
    spec = BackendSpec(name="g0", type="gpu", model=model_dir, options={"seed": 1})
    backend = build_backend(spec)
    await backend.start()
    try:
        (card,) = backend.models()
        assert card.vision
        picture = scene(300, 200, 1)
        image = image_input(300, 200, picture.tobytes())
        for content in (  # the image amid the text, and first in the message
            [
                {"type": "text", "text": "Look at"},
                {"type": "image"},
                {"type": "text", "text": QUESTION},
            ],
            [{"type": "image"}, {"type": "text", "text": QUESTION}],
        ):
            ours = [dict(p, image=image) if p["type"] == "image" else p for p in content]
            ids = await backend.render(card.id, [{"role": "user", "content": ours}])
            assert ids == transformers_ids(model_dir, content)
        stray = [
            {"type": "text", "text": "<start_of_image> sneaks in"},
            {"type": "image", "image": image},
        ]
        with pytest.raises(BadRequestError, match="2 image placeholders for 1"):
            await backend.render(card.id, [{"role": "user", "content": stray}])
    finally:
        await backend.stop(drain=False)


async def test_images_through_the_gateway_with_the_openai_client(make_gateway, model_dir):
    spec = BackendSpec("g", "gpu", model_dir, "tiny-gemma3", {"seed": 1})
    gw = await make_gateway([spec])
    _, key = await gw.tenant()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    assert [m.vision for m in (await client.models.list()).data] == [True]

    async def ask(url: str, text: str = QUESTION):
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        return await client.chat.completions.create(
            model="tiny-gemma3",
            messages=[{"role": "user", "content": parts}],
            max_tokens=6,
            temperature=0,
        )

    first = await ask(encoded(1))
    ids = transformers_ids(model_dir, [{"type": "image"}, {"type": "text", "text": QUESTION}])
    usage = first.usage
    assert usage.prompt_tokens == len(ids) and usage.prompt_tokens_details.image_tokens == 16
    # the answer is the engine's greedy output on transformers' ids and the picture
    picture = scene(300, 200, 1)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = LLM(model_dir).generate(
        [ids], greedy, images=[[image_input(300, 200, picture.tobytes())]]
    )[0]
    assert first.choices[0].message.content == want.text
    again = (await ask(encoded(1))).usage
    other = (await ask(encoded(7))).usage  # another picture of the same size
    assert again.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
    soft = ids.index(
        AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<image_soft_token>")
    )
    assert other.prompt_tokens_details.cached_tokens == soft // 16 * 16
    with pytest.raises(openai.BadRequestError, match="placeholders"):
        await ask(encoded(1), "<start_of_image> sneaks in")
