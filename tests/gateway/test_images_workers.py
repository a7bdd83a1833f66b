"""Images through kvgate workers (issue 52): a real `kvgate serve --workers 1` serving the
tiny Qwen2.5-VL (CPU here) answers the official `openai` client's chat with a picture as
the in-process gpu backend does (the same words, prompt and image tokens), its card says
vision, and the same picture again is a prefix-cache hit in the worker while another of
the same size is not. Behind a remote entry, an in-process worker: the gateway renders a
chat with images through the worker's /tokenize (the client's files, base64), keys the
blocks for routing as the worker's engine does (its placeholder id from the worker's
/v1/models), and the worker decodes each file itself and refuses image parts it was not
sent, too many images, a file over its pixel limit, and a file whose pixels are not the
size or digest sent. Its body limit follows max_image_bytes, not the pixels."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from gateway.backends import BackendSpec, GenRequest, SamplingParams, build_backends
from gateway.backends.remote_images import IMAGE_REF
from gateway.config import Settings
from gateway.http.server import GatewayTestServer
from gateway.http.util import SETTINGS
from gateway.serving.images import decode_image
from gateway.worker.app import create_worker_app, worker_body_bytes
from gateway.worker.state import WorkerState
from tests.backend_gpu.tiny_qwen2_5_vl import save_tiny_qwen2_5_vl, scene
from tests.conftest import start_gateway

TEXT = "Describe the picture in a few words, please, as briefly as you can manage it."
BODY = 200_000  # the served gateway's max_body_bytes: a request's PNG and text fit


def png(seed: int, width: int = 300, height: int = 200) -> bytes:
    out = io.BytesIO()
    scene(width, height, seed).save(out, "PNG")
    return out.getvalue()


def encoded(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


# as the gateway decodes them: their pixels, digests and files
RED, BLUE = decode_image(png(1), 10**6), decode_image(png(7), 10**6)


def ask(url: str) -> list[dict]:
    parts = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


def chat(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": TEXT}, image]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    args = ["--backend", "gpu", "--model", model_dir, "--served-model-name", "tiny-vl"]
    # the worker's body limit makes room for max_image_bytes of file besides the
    # request's own (its /generate carries the prompt's ids too), from the limits the
    # gateway passes it
    config = f"[server]\nmax_body_bytes = {BODY}\nmax_image_bytes = 150000\n"
    gw = start_gateway(
        tmp_path_factory.mktemp("served"), *args, "--workers", "1", config=config, timeout=300
    )
    yield gw
    gw.stop()


async def test_a_worker_answers_as_the_in_process_backend(served, make_gateway, model_dir):
    ref = await make_gateway([BackendSpec("vl", "gpu", model_dir, "tiny-vl", {"seed": 1})])
    _, ref_key = await ref.tenant()
    _, key = served.tenant_key("acme")
    clients = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=k, max_retries=0)
        for url, k in ((ref.url, ref_key), (served.url, key))
    ]
    for client in clients:
        assert [m.vision for m in (await client.models.list()).data] == [True]

    async def reply(client, seed: int):
        return await client.chat.completions.create(
            model="tiny-vl", messages=ask(encoded(seed)), max_tokens=6, temperature=0
        )

    expected, first = [await reply(c, 1) for c in clients]
    assert first.choices[0].message.content == expected.choices[0].message.content
    assert first.usage.prompt_tokens == expected.usage.prompt_tokens
    image_tokens = first.usage.prompt_tokens_details.image_tokens
    assert image_tokens == expected.usage.prompt_tokens_details.image_tokens > 0
    again, other = await reply(clients[1], 1), await reply(clients[1], 7)
    assert again.choices[0].message.content == expected.choices[0].message.content
    # the repeat hits every full block but the last; the other picture only the blocks
    # before its placeholders
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert cached < again.usage.prompt_tokens_details.cached_tokens


async def test_routing_keys_and_the_workers_tokenize(make_gateway, model_dir):
    spec = BackendSpec("vl", "gpu", model_dir, "tiny-vl", {"seed": 1})
    settings = Settings(
        backend="gpu",
        max_images_per_request=2,
        max_image_pixels=300 * 200,
        max_image_bytes=300_000,
    )
    state = WorkerState(settings, build_backends(spec)[0], "gpu", None)
    app = create_worker_app(state)
    limit = worker_body_bytes(settings)
    assert app._client_max_size == app[SETTINGS].max_body_bytes == limit
    # room for two files of max_image_bytes in base64, not for pixels (4 bytes a pixel)
    assert limit == settings.max_body_bytes + 2 * (400_000 + 512)
    worker = GatewayTestServer(app, state.settings)
    await state.backend.start()
    await worker.start_server()
    try:
        url = str(worker.make_url("/v1"))
        gw = await make_gateway([BackendSpec("up", "remote", "tiny-vl", "up", {"urls": [url]})])
        (remote,) = gw.state.backends
        assert [c.vision for c in remote.models()] == [True]
        ids = await remote.render("up", chat({"type": "image", "image": RED}))
        assert ids == await state.backend.render("tiny-vl", chat({"type": "image", "image": RED}))
        _, key = await gw.tenant()  # the gateway's /tokenize: decoded, then the worker's
        r = await gw.post("/tokenize", key, {"model": "up", "messages": ask(encoded(1))})
        assert (await r.json())["tokens"] == ids
        keys = remote.block_hashes(ids, "t", images=[RED])
        assert keys and keys == state.backend.block_hashes(ids, "t", images=[RED])
        blue = remote.block_hashes(ids, "t", images=[BLUE])
        assert blue[0] == keys[0] and blue[-1] != keys[-1]  # keyed by what it shows

        ref = {"type": "image_url", "image_url": {"url": IMAGE_REF}}
        body = {"model": "tiny-vl", "messages": chat(ref), "images": [RED.to_dict()]}
        large = decode_image(png(1, 400, 300), 10**6)  # 120,000 pixels: over the worker's
        async with httpx.AsyncClient(base_url=str(worker.make_url(""))) as http:
            assert (await http.post("/tokenize", json=body)).json()["tokens"] == ids
            cases = {  # (what is sent, what the 400 says)
                "not_sent": (body | {"images": []}, "0 sent"),
                "another_url": (body | {"messages": ask(encoded(1))}, "body's `images`"),
                "too_many": (body | {"images": [RED.to_dict()] * 3}, "max_images_per_request"),
                "unplaced": (body | {"images": [RED.to_dict()] * 2}, "2 images sent for 1"),
                "digest": (body | {"images": [RED.to_dict() | {"digest": BLUE.digest}]}, "digest"),
                "file": (body | {"images": [BLUE.to_dict() | {"digest": RED.digest}]}, "digest"),
                "size": (body | {"images": [RED.to_dict() | {"width": 299}]}, "not 299x200"),
                "pixels": (body | {"images": [large.to_dict()]}, "(max_image_pixels)"),
            }
            gen = GenRequest("r1", "tiny-vl", ids, SamplingParams(max_tokens=2), images=[RED] * 3)
            r = await http.post("/kvgate/v1/generate", json=gen.to_dict())
            assert r.status_code == 400 and "max_images_per_request" in r.text
            # /generate decodes and checks its images' files as /tokenize does
            gen = GenRequest("r2", "tiny-vl", ids, SamplingParams(max_tokens=2), images=[BLUE])
            forged = gen.to_dict()
            forged["images"][0]["digest"] = RED.digest
            r = await http.post("/kvgate/v1/generate", json=forged)
            assert r.status_code == 400 and "digest does not match" in r.text
            for case, (sent, said) in cases.items():
                r = await http.post("/tokenize", json=sent)
                assert r.status_code == 400, (case, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and said in error["message"], case
    finally:
        await worker.close()
        await state.backend.stop(drain=False)
