"""chat_template_kwargs on the engines' own templates (issue 48): Qwen3's real template
on a tiny random Qwen3 writes an empty think block into the prompt when
`enable_thinking` is false. A `kvgate worker` behind a remote entry renders with them: the
gateway's /tokenize (vLLM's field) counts them, and the prompt a chat is given, and
billed for, is the one rendered with them."""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from gateway.backends import BackendSpec, build_backends
from gateway.config import Settings
from gateway.http.server import GatewayTestServer
from gateway.worker.app import create_worker_app
from gateway.worker.state import WorkerState
from tests.gateway.test_reasoning_first_engine import model_dir  # noqa: F401 (a fixture)

ASK = [{"role": "user", "content": "Weather in Oslo?"}]
OFF = {"enable_thinking": False}


async def test_tokenize_and_a_worker_render_with_them(make_gateway, model_dir):  # noqa: F811
    empty_block = len(AutoTokenizer.from_pretrained(model_dir).encode("<think>\n\n</think>\n\n"))
    spec = BackendSpec("tiny", "gpu", model_dir, "tiny", {"max_num_batched_tokens": 256})
    state = WorkerState(Settings(backend="gpu"), build_backends(spec)[0], "gpu", None)
    worker = GatewayTestServer(create_worker_app(state), state.settings)
    await state.backend.start()
    await worker.start_server()
    try:
        url = str(worker.make_url("/v1"))
        gw = await make_gateway([BackendSpec("up", "remote", "up", "up", {"urls": [url]})])
        _, key = await gw.tenant("acme")
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=gw.url, headers=auth) as http:
            ask = {"model": "up", "messages": ASK}  # through the worker's /tokenize
            plain = (await http.post("/tokenize", json=ask)).json()["count"]
            off = await http.post("/tokenize", json=ask | {"chat_template_kwargs": OFF})
            assert off.json()["count"] > plain  # the empty block, and its tokens' merges
        client = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        asked = {"model": "up", "messages": ASK, "max_tokens": 2}
        on = await client.chat.completions.create(**asked)
        off_reply = await client.chat.completions.create(
            **asked, extra_body={"chat_template_kwargs": OFF}
        )
        grown = off_reply.usage.prompt_tokens - on.usage.prompt_tokens
        assert grown == off.json()["count"] - plain and 0 < grown <= empty_block + 1
    finally:
        await worker.close()
        await state.backend.stop(drain=False)
