"""Images on the llama.cpp backend (an entry's `mmproj`): a tiny Gemma 3 vision model's
text GGUF and the mmproj GGUF llama.cpp's converter writes (tiny_vision_gguf.py), served
by kvgate's batched engine, against llama-cpp-python's own single-sequence path on the
same two files (its MTMDChatHandler through Llama.create_chat_completion, greedy):
token for token with one image, with two requests of different images decoded
together, and a different image after the same text is prefilled again (never a
prefix-cache hit across images), while the same image again is one. Then `kvgate serve`
with such an entry, driven by the openai client with a data URL."""

from __future__ import annotations

import asyncio
import base64
import io

import llama_cpp
import openai
import pytest
from llama_cpp.llama_chat_format import MTMDChatHandler

from engine_api.errors import BackendError, BadRequestError
from engine_api.images import ImageInput, image_input
from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams
from gateway.backends.local import LocalBackend
from gateway.backends.spec import BackendSpec
from tests.backend_gpu.tiny_qwen2_5_vl import scene
from tests.conftest import start_gateway

pytestmark = pytest.mark.slow

MAX_NEW = 12
BEFORE, AFTER = "A picture: ", ""
OPTIONS = dict(n_ctx=512, n_parallel=2, n_batch=64, n_threads=1)


def picture(seed: int) -> tuple[ImageInput, str]:
    """A drawn picture (48x40) as the gateway hands it to a backend, and as a PNG data URL."""
    image = scene(48, 40, seed)
    out = io.BytesIO()
    image.save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return image_input(48, 40, image.tobytes()), url


def chat(image: ImageInput) -> list[dict]:
    parts = [{"type": "text", "text": BEFORE}, {"type": "image", "image": image}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": AFTER}]}]


@pytest.fixture(scope="module")
def files(vision_gguf) -> tuple[str, str]:
    return vision_gguf


@pytest.fixture(scope="module")
def reference(files):
    """llama-cpp-python's own greedy answer to a picture's chat: the ids it generated
    and evaluated (all, when it ended at an end-of-generation token, which it leaves
    out; its length limit is looser than MAX_NEW, as it runs on past the limit to end
    a UTF-8 character, so the ids cover ours), and whether it so ended."""
    text_model, mmproj = files
    llama = llama_cpp.Llama(
        text_model,
        chat_handler=MTMDChatHandler(mmproj, verbose=False),
        n_ctx=512,
        n_batch=64,
        n_threads=1,
        verbose=False,
    )
    answers: dict[int, tuple[list[int], bool]] = {}

    def answer(seed: int) -> tuple[list[int], bool]:
        if seed not in answers:
            url = picture(seed)[1]
            parts = [{"type": "text", "text": BEFORE}]
            parts += [{"type": "image_url", "image_url": {"url": url}}]
            parts += [{"type": "text", "text": AFTER}]
            reply = llama.create_chat_completion(
                [{"role": "user", "content": parts}],
                temperature=0,
                repeat_penalty=1.0,
                max_tokens=MAX_NEW + 8,
            )
            ids = llama.input_ids[reply["usage"]["prompt_tokens"] : llama.n_tokens]
            ended = reply["choices"][0]["finish_reason"] == "stop"
            answers[seed] = ([int(t) for t in ids], ended)
        return answers[seed]

    yield answer
    llama.close()


@pytest.fixture
async def backend(files):
    text_model, mmproj = files
    backend = LocalBackend(
        BackendSpec("vl", "local", text_model, "tiny-vl", OPTIONS | {"mmproj": mmproj})
    )
    await backend.start()
    yield backend
    await backend.stop()


def assert_same(ours: list[int], finish: str, theirs: tuple[list[int], bool]) -> None:
    """Our greedy ids are llama-cpp-python's, token for token (ours end with the
    end-of-generation token where it stopped there; it leaves that out)."""
    ids, ended = theirs
    if finish == "stop":
        assert ended and ours[:-1] == ids
    else:
        assert len(ours) == MAX_NEW and ids[:MAX_NEW] == ours


async def generate(backend: LocalBackend, request_id: str, image: ImageInput):
    """(text, ids, last chunk) of the picture's chat on the backend, greedy."""
    prompt = await backend.render_chat("tiny-vl", chat(image), None, {})
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    req = GenRequest(request_id, "tiny-vl", prompt, params, images=[image])
    text, ids, last = "", [], None
    async for chunk in backend.generate(req):
        text, ids, last = text + chunk.text, ids + chunk.token_ids, chunk
    return text, ids, last


def test_the_card_says_vision(backend):
    assert backend.models()[0].vision is True


async def test_one_image_equals_llama_cpp_pythons_own_path(backend, reference):
    _, ids, last = await generate(backend, "one", picture(1)[0])
    assert_same(ids, last.finish_reason, reference(1))
    # Gemma 3's projector: 4 tokens an image (32x32 pixels pooled), counted as prompt
    assert last.usage.image_tokens == 4 and last.usage.prompt_tokens > 4


async def test_two_images_decoded_together_each_equal_its_own(backend, reference):
    (a, _), (b, _) = picture(1), picture(2)
    (_, ids_a, last_a), (_, ids_b, last_b) = await asyncio.gather(
        generate(backend, "a", a), generate(backend, "b", b)
    )
    assert_same(ids_a, last_a.finish_reason, reference(1))
    assert_same(ids_b, last_b.finish_reason, reference(2))
    assert ids_a != ids_b  # the pictures, not the text, made them differ


async def test_another_image_after_the_same_text_is_prefilled_again(backend, reference):
    image, other = picture(4)[0], picture(2)[0]
    _, first_ids, _ = await generate(backend, "first", image)
    computed = backend.stats().extra["prompt_tokens_total"]
    _, ids, last = await generate(backend, "other", other)
    assert_same(ids, last.finish_reason, reference(2))
    assert ids != first_ids
    second = last.usage
    # only the text before the image was found cached: the image and all after it ran
    prompt = await backend.render_chat("tiny-vl", chat(other), None, {})
    image_at = prompt.index(backend.image_token_id)
    assert second.cached_tokens <= image_at
    assert backend.stats().extra["prompt_tokens_total"] - computed >= len(prompt) - image_at
    # the same picture again: its cells are reused past the image, the answer the same
    _, ids_again, last_again = await generate(backend, "again", other)
    assert last_again.usage.cached_tokens > image_at + second.image_tokens
    assert ids_again == ids


async def test_prefix_events_key_an_images_blocks_as_the_router_does(backend):
    image, other = picture(1)[0], picture(2)[0]
    await generate(backend, "events", image)
    stored = {e.block_hash for e in backend.kv_events() if e.kind == "stored"}
    prompt = await backend.render_chat("tiny-vl", chat(image), None, {})
    mine = backend.block_hashes(prompt, None, images=[image])
    assert len(mine) == len(prompt) // 16 and set(mine) <= stored
    # the blocks from the image's on are another picture's under its digest
    image_block = prompt.index(backend.image_token_id) // 16
    theirs = backend.block_hashes(prompt, None, images=[other])
    assert theirs[:image_block] == mine[:image_block]
    assert not set(theirs[image_block:]) & stored


async def test_what_cannot_be_served_with_images_is_a_bad_request(backend):
    image = picture(6)[0]
    prompt = await backend.render_chat("tiny-vl", chat(image), None, {})
    greedy = SamplingParams(temperature=0, max_tokens=2)
    at = prompt.index(backend.image_token_id)
    refused = [  # (prompt, images, sampling, what the 400 says)
        (prompt, [image] * 2, greedy, "image placeholders for 2 images"),
        (prompt[: at + 4], [image], greedy, "must end in text after its last image"),
        (prompt, [image], SamplingParams(max_tokens=2, prompt_logprobs=1), "prompt_logprobs"),
    ]
    for ids, images, params, says in refused:
        with pytest.raises(BadRequestError, match=says):
            async for _ in backend.generate(GenRequest("x", "tiny-vl", ids, params, images=images)):
                pass
    # a text that holds the image token itself, beside an image: which is the image's?
    stray = chat(image)
    stray[0]["content"][0]["text"] = "<image_soft_token> here: "
    with pytest.raises(BadRequestError, match="holds the image placeholder token"):
        await backend.render_chat("tiny-vl", stray, None, {})


async def test_a_projector_that_cannot_serve_is_refused_at_start(files, tmp_path):
    text_model, _ = files
    missing = BackendSpec("vl", "local", text_model, "", {"mmproj": str(tmp_path / "no.gguf")})
    with pytest.raises(BackendError, match="local backend 'vl': mmproj: no such file: .*no.gguf"):
        await LocalBackend(missing).start()
    # the text model's own file is no projector: libmtmd's refusal, named
    wrong = BackendSpec("vl", "local", text_model, "", {"mmproj": text_model})
    with pytest.raises(BackendError, match="mmproj: libmtmd could not load the projector"):
        await LocalBackend(wrong).start()
    embed = BackendSpec("e", "local", text_model, "", {"task": "embed", "mmproj": text_model})
    with pytest.raises(BackendError, match="an embedding engine takes none"):
        await LocalBackend(embed).start()


async def test_kvgate_serve_answers_an_image_url_with_the_openai_client(
    tmp_path_factory, files, backend
):
    """The answer through `kvgate serve` is the in-process backend's (checked against
    llama-cpp-python's above), its usage counts the image."""
    text_model, mmproj = files
    image, url = picture(1)
    want, _, _ = await generate(backend, "in-process", image)
    config = f"""
[[backends]]
name = "vl"
type = "local"
model = "{text_model}"
served_model_name = "tiny-vl"
options = {{ n_ctx = 512, n_parallel = 2, n_batch = 64, n_threads = 1, mmproj = "{mmproj}" }}
"""
    gw = start_gateway(tmp_path_factory.mktemp("serve-mmproj"), config=config, timeout=120)
    try:
        _, key = gw.tenant_key("vision")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        assert [m.vision for m in client.models.list().data] == [True]
        parts = [{"type": "text", "text": BEFORE}]
        parts += [{"type": "image_url", "image_url": {"url": url}}]
        parts += [{"type": "text", "text": AFTER}]
        reply = client.chat.completions.create(
            model="tiny-vl",
            messages=[{"role": "user", "content": parts}],
            max_tokens=MAX_NEW,
            temperature=0,
        )
        assert reply.choices[0].message.content == want
        assert reply.usage.prompt_tokens_details.image_tokens == 4
    finally:
        gw.stop()
